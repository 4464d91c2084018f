"""Packed documents in tensor form in the Gated DeltaNet, and FLA's chunk_gated_delta_rule: on CPU, the dispatch and
the call's arguments with a fake `fla` module (a per-document reference that honours cu_seqlens), packed documents
laid end to end equal to each alone, and the log line saying which rule runs; the chunked rule and the conv reset
by document offsets, and compiled blocks on packed documents (the offsets form), equal to each document alone; on
CUDA with fla-core installed, FLA against the reference path."""

import itertools
import logging
import sys
from types import ModuleType

import pytest
import torch

from tests.hf_oracle import check_packed_equals_alone
from titan_lite.models.decoder import Llama
from titan_lite.models.flavors import flavor_args
from titan_lite.models.parts import gated_deltanet
from titan_lite.models.parts.gated_deltanet import DocumentOffsets, causal_conv, chunked_delta_rule
from titan_lite.models.parts.masks import DocumentSpans

LENGTHS = [13, 29, 22]  # none a multiple of tiny_qwen3_5's 16-step chunk


def tiny_model(device: str = "cpu") -> Llama:
    model = Llama(flavor_args("tiny_qwen3_5"))
    model.init_weights(seed=0)
    return model.to(device)


def documents(device: str = "cpu") -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, 2048, (n,), generator=generator).to(device) for n in LENGTHS]


@pytest.fixture
def fake_fla(monkeypatch):
    """FLA "installed" and used on CPU tensors: its chunk_gated_delta_rule runs our chunked form per document of
    cu_seqlens (or per row), recording each call's arguments."""
    calls = []

    def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, **rest):
        calls.append(dict(q=q.shape, v=v.shape, g=g.dtype, initial_state=initial_state,
                          output_final_state=output_final_state, l2norm=use_qk_l2norm_in_kernel,
                          cu_seqlens=None if cu_seqlens is None else cu_seqlens.tolist(), rest=rest))
        if cu_seqlens is None:
            return chunked_delta_rule(q, k, v, g, beta, state=initial_state)
        bounds = cu_seqlens.tolist()
        runs = [chunked_delta_rule(*(t[:, s:e] for t in (q, k, v, g, beta))) for s, e in itertools.pairwise(bounds)]
        return torch.cat([out for out, _ in runs], dim=1), torch.cat([state for _, state in runs])

    module = ModuleType("fla.ops.gated_delta_rule")
    module.chunk_gated_delta_rule = chunk_gated_delta_rule
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", module)
    monkeypatch.setattr(gated_deltanet, "FLA_INSTALLED", True)
    monkeypatch.setattr(gated_deltanet, "uses_fla", lambda t: True)
    return calls


def test_packed_documents_run_end_to_end_through_fla_with_cu_seqlens(fake_fla, caplog):
    model = tiny_model()
    gated_deltanet._say.cache_clear()
    with caplog.at_level(logging.INFO, logger="titan_lite"):
        check_packed_equals_alone(model, documents())
    packed = fake_fla[0]  # the first call: layer 0 of the packed row
    assert packed["cu_seqlens"] == [0, 13, 42, 64]
    assert (tuple(packed["q"]), tuple(packed["v"])) == ((1, 64, 2, 16), (1, 64, 4, 16))  # key heads not repeated
    assert (packed["g"], packed["initial_state"], packed["l2norm"], packed["rest"]) == (torch.float32, None, True, {})
    assert all(call["cu_seqlens"] is None for call in fake_fla[3:])  # each document alone: no cu_seqlens
    assert "Gated DeltaNet layers: FLA's chunk_gated_delta_rule on cpu" in caplog.text


def test_without_fla_the_log_names_the_pure_pytorch_rule(monkeypatch, caplog):
    monkeypatch.setattr(gated_deltanet, "FLA_INSTALLED", False)
    gated_deltanet._say.cache_clear()
    with caplog.at_level(logging.INFO, logger="titan_lite"), torch.no_grad():
        tiny_model()(documents()[0][None])
    assert "Gated DeltaNet layers: the pure-PyTorch chunked delta rule on cpu (fla-core is not installed)" in \
        caplog.text


def test_the_conv_with_document_offsets_equals_each_document_alone():
    generator = torch.Generator().manual_seed(2)
    channels, kernel = 6, 4
    weight = torch.randn(channels, 1, kernel, generator=generator)
    x = torch.randn(1, channels, sum(LENGTHS), generator=generator)
    ends = DocumentOffsets.end_to_end(DocumentSpans((((0, 13), (13, 42), (42, 64)),)), torch.device("cpu"))
    packed = causal_conv(torch.nn.functional.pad(x, (kernel - 1, 0)), weight, ends.offsets)
    bounds = ends.cu_seqlens.tolist()
    alone = [causal_conv(torch.nn.functional.pad(x[..., s:e], (kernel - 1, 0)), weight)
             for s, e in itertools.pairwise(bounds)]
    torch.testing.assert_close(packed, torch.cat(alone, dim=-1), rtol=0, atol=1e-6)


def test_the_chunked_rule_with_document_offsets_equals_each_document_alone():
    generator = torch.Generator().manual_seed(4)

    def draw(*shape):
        return torch.randn(*shape, generator=generator)

    rows = [LENGTHS, [16, 16, 5, 27]]  # starts inside a chunk, on a chunk's first step, and a 5-step document
    q, k, v = draw(2, 64, 2, 8), draw(2, 64, 2, 8), draw(2, 64, 4, 6)
    g, beta = -torch.nn.functional.softplus(draw(2, 64, 4)), draw(2, 64, 4).sigmoid()
    documents = torch.tensor([sum(([i] * n for i, n in enumerate(row)), []) for row in rows])
    offsets = DocumentOffsets.of_rows(documents).offsets
    assert offsets[1, 14:18].tolist() == [14, 15, 0, 1]
    for chunk in (16, 7):
        out, _ = chunked_delta_rule(q, k, v, g, beta, chunk=chunk, offsets=offsets)
        for b, row in enumerate(rows):
            bounds = [0, *itertools.accumulate(row)]
            alone = [chunked_delta_rule(*(t[b:b + 1, s:e] for t in (q, k, v, g, beta)), chunk=chunk)[0]
                     for s, e in itertools.pairwise(bounds)]
            torch.testing.assert_close(out[b:b + 1], torch.cat(alone, dim=1), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_compiled_blocks_on_packed_documents_equal_each_alone():
    from titan_lite.config.schema import Compile
    from titan_lite.parallel.compile import apply_compile

    model = tiny_model()
    apply_compile(model, Compile(enable=True, backend="aot_eager"))
    check_packed_equals_alone(model, documents(), grad_atol=1e-5)


@pytest.mark.cuda
def test_fla_equals_the_reference_path_on_cuda():
    """FLA's kernel (fla-core installed) against the pure-PyTorch chunked form on the same CUDA tensors, with a
    state carried in and out; then a packed row of documents through the model (cu_seqlens) against each alone."""
    pytest.importorskip("fla.ops.gated_delta_rule")
    generator = torch.Generator().manual_seed(3)
    batch, seq, key_heads, value_heads, dk, dv = 2, 200, 2, 4, 64, 64

    def draw(*shape):
        return torch.randn(*shape, generator=generator).cuda()

    q, k, v = draw(batch, seq, key_heads, dk), draw(batch, seq, key_heads, dk), draw(batch, seq, value_heads, dv)
    g = -torch.nn.functional.softplus(draw(batch, seq, value_heads))
    beta, state = draw(batch, seq, value_heads).sigmoid(), draw(batch, value_heads, dk, dv) * 0.1
    expected, expected_state = chunked_delta_rule(q, k, v, g, beta, state=state)
    out, final = gated_deltanet.fla_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(out, expected, rtol=0, atol=2e-3)
    torch.testing.assert_close(final, expected_state, rtol=0, atol=2e-3)
    assert gated_deltanet.uses_fla(q)
    check_packed_equals_alone(tiny_model("cuda"), documents("cuda"), grad_atol=1e-3)
