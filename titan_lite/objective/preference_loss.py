"""The preference losses of pairs, from each answer's log-probability (summed over its tokens) and token count, and the
reference's: DPO (sigmoid; cDPO and robust DPO with label smoothing), hinge, IPO, SimPO and ORPO, with the rewards
TRL logs. Formulas and names follow TRL (DPOTrainer, CPOTrainer for SimPO, ORPOTrainer)."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from titan_lite.config.schema import REFERENCE_FREE

LOSSES = ("sigmoid", "ipo", "hinge", "simpo", "orpo")


@dataclass(frozen=True)
class PreferenceLoss:
    """[preference]'s loss settings."""

    loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    robust: bool = False
    simpo_gamma: float = 0.5
    sft_weight: float = 0.0

    @property
    def reference_free(self) -> bool:
        return self.loss in REFERENCE_FREE

    @property
    def averaged(self) -> bool:
        """Whether the pair term reads per-token averaged log-probabilities of the policy (SimPO, ORPO: their
        rewards and logged log-probabilities are averages too, as TRL logs them)."""
        return self.loss in REFERENCE_FREE

    @property
    def nll_weight(self) -> float:
        """Weight of the chosen answers' mean token NLL over the batch: ORPO's own term, else RPO's sft_weight."""
        return 1.0 if self.loss == "orpo" else self.sft_weight

    def describe(self) -> str:
        parts = [f"loss {self.loss}", f"beta {self.beta:g}"]
        if self.label_smoothing:
            parts.append(f"label_smoothing {self.label_smoothing:g}" + (" (robust)" if self.robust else ""))
        if self.loss == "simpo":
            parts.append(f"gamma {self.simpo_gamma:g}")
        if self.sft_weight:
            parts.append(f"sft_weight {self.sft_weight:g}")
        return ", ".join(parts)


@dataclass
class PairTerms:
    """Per pair: the loss term, the rewards of both answers and their log-probabilities as logged."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor


def pair_terms(spec: PreferenceLoss, logps: torch.Tensor, lengths: torch.Tensor,
               reference: torch.Tensor | None) -> PairTerms:
    """The loss of every pair from logps [pairs, 2] (chosen, rejected: sums over each answer's tokens), lengths
    [pairs, 2] (their token counts) and the reference's logps [pairs, 2] (None for reference-free losses)."""
    beta, eps = spec.beta, spec.label_smoothing
    if spec.reference_free:
        average = logps / lengths
        chosen, rejected = average.unbind(1)
        if spec.loss == "simpo":
            z = beta * (chosen - rejected) - spec.simpo_gamma
            losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
        else:  # orpo: the log odds of the averaged probabilities; its NLL term is added over the whole batch
            log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
            losses = -beta * F.logsigmoid(log_odds)
        return PairTerms(losses, beta * chosen.detach(), beta * rejected.detach(), chosen.detach(), rejected.detach())
    ratios = logps - reference
    h = ratios[:, 0] - ratios[:, 1]
    if spec.loss == "sigmoid":
        z = beta * h
        if spec.robust:
            losses = (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
        else:
            losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    elif spec.loss == "hinge":
        losses = torch.relu(1 - beta * h)
    else:  # ipo: the log-ratio difference of per-token averages
        averaged = ratios / lengths
        losses = (averaged[:, 0] - averaged[:, 1] - 1 / (2 * beta)) ** 2
    rewards = beta * ratios.detach()
    return PairTerms(losses, rewards[:, 0], rewards[:, 1], logps[:, 0].detach(), logps[:, 1].detach())


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation (branching at -ln 2)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))
