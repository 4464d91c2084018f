"""The titan_lite side of the family tests against transformers: a saved HF folder read into the decoder."""

import json
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from titan_lite.checkpoint.hf import load_hf_weights
from titan_lite.models.decoder import Llama
from titan_lite.models.hf.config import args_from_hf_config


def load_titan(folder, **overrides) -> Llama:
    """The folder's config.json as args (with `overrides`), its safetensors loaded, in eval mode."""
    args = replace(args_from_hf_config(json.loads((folder / "config.json").read_text())), **overrides)
    model = Llama(args)
    load_hf_weights([model], str(folder), args)
    return model.eval()


@dataclass
class Packed:
    """One row of documents packed block-causally, and the decoder's logits of it."""

    ids: torch.Tensor  # [1, seq]
    positions: torch.Tensor  # [1, seq], restarting at each document
    documents: torch.Tensor  # [1, seq], the document id of each token
    logits: torch.Tensor


def check_packed_equals_alone(model: Llama, docs: list[torch.Tensor], grad_atol: float = 1e-6) -> Packed:
    """Documents packed in one row against each run alone: equal logits, summed next-token loss (within each
    document) and every gradient. Returns the packed row and its logits, for a family's further checks."""
    lengths = [len(d) for d in docs]
    ids = torch.cat(docs)[None]
    documents = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    spans = [(sum(lengths[:i]), sum(lengths[:i + 1])) for i in range(len(lengths))]

    def loss_of(logits, tokens):
        return F.cross_entropy(logits[0, :-1], tokens[1:], reduction="sum")

    model.zero_grad()
    logits = model(ids, positions=positions, documents=documents)
    packed_loss = sum(loss_of(logits[:, s:e], ids[0, s:e]) for s, e in spans)
    packed_loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    alone = [model(doc[None]) for doc in docs]
    alone_loss = sum(loss_of(out, doc) for out, doc in zip(alone, docs, strict=True))
    alone_loss.backward()
    torch.testing.assert_close(logits, torch.cat(alone, dim=1), rtol=0, atol=1e-5)
    torch.testing.assert_close(packed_loss, alone_loss, rtol=1e-6, atol=0)
    for name, param in model.named_parameters():
        if not param.requires_grad:  # a frozen parameter (DeepSeek-V3's correction bias)
            continue
        torch.testing.assert_close(packed_grads[name], param.grad, rtol=1e-5, atol=grad_atol, msg=name)
    return Packed(ids, positions, documents, logits.detach())
