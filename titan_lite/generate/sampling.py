"""The next token of every row from its logits: the argmax, or a sample at a temperature among the top k and the
top p of the probability mass, drawn by inverse CDF from one uniform number per row (so a row's sample depends on
its own logits and number only, whatever else shares its batch); and the log-probability of the chosen token under
the full tempered distribution, or (logprobs "sampled") under the truncated, renormalised one it was drawn from
(what training computes for the same token, objective/logps.py)."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_k: int | None = None  # among the k most likely tokens (None or 0: all)
    top_p: float = 1.0  # among the smallest set of most likely tokens holding this much probability
    logprobs: str = "full"  # "full": of the full tempered distribution, or of the truncated one sampled from

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def truncates(self) -> bool:
        """Whether top k or top p leave tokens out of the draw."""
        return bool(self.top_k) or self.top_p < 1.0

    @property
    def sampled(self) -> bool:
        """Whether log-probabilities are those of the truncated distribution the draw uses (it truncates)."""
        return self.logprobs == "sampled" and not self.greedy and self.truncates


def filtered_probabilities(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """[batch, vocab] float32 probabilities of softmax(logits / temperature) restricted to the top k and top p
    (renormalised)."""
    x = logits.float() / s.temperature
    if s.top_k:
        kth = x.topk(min(s.top_k, x.shape[-1]), dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = x.softmax(dim=-1)
    if s.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # the mass of the more likely tokens
        sorted_probs = sorted_probs.masked_fill(before > s.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def kept_tokens(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """[batch, vocab] bool: the tokens the draw can pick (a probability above 0 in filtered_probabilities)."""
    return filtered_probabilities(logits, s) > 0


def choose(logits: torch.Tensor, s: Sampling, uniforms: torch.Tensor | None) -> torch.Tensor:
    """[batch, vocab] logits -> [batch] token ids: the argmax, or the token whose CDF interval holds the row's
    uniform number in [0, 1)."""
    return choose_with(logits, s, uniforms)[0]


def choose_with(logits: torch.Tensor, s: Sampling, uniforms: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(choose's token ids, the filtered probabilities they were drawn from, or None when greedy)."""
    if s.greedy:
        return logits.argmax(dim=-1), None
    probs = filtered_probabilities(logits, s)
    return draw(probs, uniforms), probs


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token of every row whose CDF interval (of `probs` [batch, vocab]) holds the row's uniform number."""
    cdf = probs.cumsum(dim=-1)
    target = (uniforms.to(cdf.device, torch.float32) * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)


def chosen_logps(logits: torch.Tensor, tokens: torch.Tensor, s: Sampling,
                 probs: torch.Tensor | None = None) -> torch.Tensor:
    """[batch] float32 log-probabilities of `tokens` under softmax(logits / temperature) (temperature 1 when greedy):
    the full tempered distribution; with s.sampled, under the truncated, renormalised one (filtered_probabilities,
    or `probs` when they are at hand), as the training forward scores them either way."""
    if s.sampled:
        probs = filtered_probabilities(logits, s) if probs is None else probs
        return probs.gather(1, tokens[:, None]).squeeze(1).log()
    scale = 1.0 if s.greedy else 1.0 / s.temperature
    return torch.log_softmax(logits.float() * scale, dim=-1).gather(1, tokens[:, None]).squeeze(1)
