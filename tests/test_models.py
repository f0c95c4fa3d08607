"""The model zoo: published parameter counts, trainability at tiny size, deterministic batches.

Full-size models are built on the meta device, so counting the 823M-parameter LSTM allocates nothing.
"""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from gradsync.models import get_model, model_names
from gradsync.models.layers import sinusoidal_positions

ZOO = ["resnet50", "resnet101", "vgg19", "vgg16", "inception_v3", "mobilenet_v2", "transformer-nmt", "bert-base", "lstm-lm", "sockeye-rnn", "recsys"]

# torchvision's counts for the vision models; the NLP counts are derived in each module's docstring.
FULL_PARAMS = {
    "resnet50": 25_557_032,
    "resnet101": 44_549_160,
    "vgg19": 143_667_240,
    "vgg16": 138_357_544,
    "inception_v3": 27_161_264,
    "mobilenet_v2": 3_504_872,
    "transformer-nmt": 60_556_544,
    "bert-base": 110_106_428,  # encoder + pooler + masked-LM and next-sentence heads
    "lstm-lm": 822_761_343,
    "sockeye-rnn": 25_634_333,
    "recsys": 540_677_217,  # 26 Criteo Kaggle tables of width 16 and the two MLPs
}

pytestmark = pytest.mark.filterwarnings("ignore:LSTM with projections:UserWarning")


def build_on_meta(name: str, **options) -> torch.nn.Module:
    return get_model(name, **options).build_meta()


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() lists a tied weight once


def test_zoo_is_registered():
    assert set(ZOO) <= set(model_names())


@pytest.mark.parametrize("name", ZOO)
def test_full_size_parameter_count(name):
    assert count(build_on_meta(name)) == FULL_PARAMS[name]


@pytest.mark.parametrize("name", ZOO)
def test_a_model_on_the_meta_device_has_the_built_ones_parameters(name):
    real, meta = get_model(f"{name}:tiny").build(), build_on_meta(f"{name}:tiny")
    assert [(n, p.shape, p.dtype, p.requires_grad) for n, p in real.named_parameters()] == \
        [(n, p.shape, p.dtype, p.requires_grad) for n, p in meta.named_parameters()]
    assert all(p.is_meta for p in meta.parameters()) and all(not p.is_meta for p in real.parameters())


def test_building_on_the_meta_device_runs_no_initializer():
    # An initializer on a meta tensor goes through PyTorch's Python decompositions, which import
    # torch._dynamo: seconds of every process that only needs the shapes (a bench's memory check).
    code = ("import sys\n"
            "from gradsync.models import get_model\n"
            "for name in ('toy', 'lstm-lm:cpu', 'bert-base', 'transformer-nmt', 'vgg19'):\n"
            "    get_model(name).build_meta()\n"
            "print('torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["False"], done.stdout + done.stderr


def test_inception_without_aux_classifier():
    assert count(build_on_meta("inception_v3", aux_logits=False)) == 23_834_568


def test_bert_base_encoder_and_pooler():
    assert build_on_meta("bert-base").encoder_param_count() == 109_482_240


@pytest.mark.parametrize("name", ZOO)
def test_tiny_model_trains(name):
    spec = get_model(f"{name}:tiny")
    torch.manual_seed(0)
    model = spec.build().train()
    inputs, target = spec.batch(4, seed=0)
    loss = spec.loss(model(*inputs), target)
    assert loss.dim() == 0 and math.isfinite(loss.item())
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert missing == []


def test_inception_aux_logits_only_while_training():
    spec = get_model("inception_v3:tiny")
    model = spec.build()
    (images,), target = spec.batch(2, seed=0)
    assert isinstance(model.train()(images), tuple)
    logits = model.eval()(images)
    assert logits.shape == (2, 10)
    assert torch.isfinite(spec.loss(logits, target))


@pytest.mark.parametrize("name", ZOO)
def test_batches_are_deterministic_per_seed(name):
    spec = get_model(f"{name}:tiny")
    first, again, other = spec.batch(4, seed=0), spec.batch(4, seed=0), spec.batch(4, seed=1)
    flat = [[*inputs, target] for inputs, target in (first, again, other)]
    assert all(torch.equal(a, b) for a, b in zip(flat[0], flat[1]))
    assert not all(torch.equal(a, b) for a, b in zip(flat[0], flat[2]))
    assert all(t.device.type == "cpu" and t.dtype in (torch.float32, torch.int64) for t in flat[0])


def test_lstm_tokens_follow_zipf():
    (tokens,), _ = get_model("lstm-lm:tiny").batch(64, seed=0)
    # Under Zipf(1) over 2,000 ids, ids 0-9 carry H(10)/H(2000) = 36% of the mass; uniform would give 0.5%.
    assert 0.25 < (tokens < 10).float().mean().item() < 0.5


def test_lstm_sparse_embedding_gradient():
    spec = get_model("lstm-lm:tiny", sparse=True)
    model = spec.build()
    inputs, target = spec.batch(2, seed=0)
    spec.loss(model(*inputs), target).backward()
    assert model.embedding.weight.grad.is_sparse
    assert not model.softmax.weight.grad.is_sparse


def test_sinusoidal_positions_formula():
    table = sinusoidal_positions(50, 16)
    pos, i = 37, 3
    angle = pos / 10000 ** (2 * i / 16)
    expected = torch.tensor([math.sin(angle), math.cos(angle)])
    torch.testing.assert_close(table[pos, 2 * i : 2 * i + 2], expected)


def test_unknown_model_lists_valid_names():
    with pytest.raises(ValueError, match="valid models: .*resnet50"):
        get_model("nope")


def test_unknown_size_lists_valid_sizes():
    with pytest.raises(ValueError, match="valid sizes: full, tiny"):
        get_model("resnet50:huge")


@pytest.mark.parametrize(
    "name, valid", [("resnet50", "image_size, num_classes"), ("lstm-lm", "num_sampled, seq_len, softmax, sparse")]
)
def test_unknown_option_lists_valid_options(name, valid):
    with pytest.raises(ValueError, match=f"unknown option.*depth.*valid options: {valid}"):
        get_model(name, depth=3)
