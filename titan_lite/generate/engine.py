"""The rollout's decode engine (gpt-fast style, outside the training forward): continuous batching over a fixed number
of slots, each prompt prefilled once for all of its completions, a static-shape decode step torch.compile can capture
whole, and the host reading the device only every `stop_check_interval` steps.

A completion's tokens and log-probabilities do not depend on the slot or the company it decodes in: each draw uses
the completion's own uniform number for that token (uniforms[completion, token]), and a row's logits are its own
sequence's. What batch composition can change is rounding: a matmul over 64 rows may block its sums differently
from one over 1 row, moving a logit by an ulp or so, which can flip a token only where two logits tie to that
precision or a uniform falls within that of a CDF boundary (tests/test_engine.py checks the samples equal one
completion decoded alone, greedy and sampled).

Between checks a slot whose completion has ended keeps stepping (its writes go to a spare row of the outputs), so the
results are those of a check every step; at a check the ended slots take the next pending completions: the staging
row holds the last prompt prefilled, copied (keys, values, Gated DeltaNet conv windows and states) into the slots.

On a sharded layout whose forward issues collectives (FSDP gathering layer by layer, TP, CP, EP) a `Lockstep` makes
every rank run the same forwards in the same order, whatever its own work: at each check the ranks agree (one
all-reduce MAX) on whether any still has work and on the most decode steps any has left before its next check, and
all of them run that many steps (a rank without work steps its idle slots); each prefill is preceded by an
all-reduce of "I prefill", and a rank with nothing to prefill runs an idle prefill (one padding token, into a
scratch cache) for each one another rank runs, until none wants one. The ranks of one TP or CP group hold the same
prompts and draws, so they take the same decisions and shapes; forwards of ranks that share only FSDP's all-gathers
may differ in shape (the gathers do not). With TP every forward is a multiple of the TP degree long (sequence
parallelism splits it): a decode step feeds each slot's token after TP - 1 padding tokens."""

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from titan_lite.dtensor import full_tensor
from titan_lite.generate.decode import Decoded, GenerationConfig, Lockstep, left_padded
from titan_lite.generate.sampling import choose_with, chosen_logps
from titan_lite.generate.slots import DecodeView, PrefillView, SlotCache

COLUMN_BUCKET = 64  # an eager step attends over the columns in use, rounded up to this (a few shapes)


@dataclass
class EngineStats:
    """What a rollout's decoding did: decode steps, slot-steps run and those that produced a token, prefills (and
    their tokens), idle prefills (a lockstep's, for another rank's), and the seconds of both phases (the device
    synchronised around each prefill when `timed`)."""

    decode_steps: int = 0
    slot_steps: int = 0
    working_slot_steps: int = 0
    prefills: int = 0
    prefill_tokens: int = 0
    prefill_forwards: int = 0
    idle_prefills: int = 0
    prefill_s: float = 0.0
    total_s: float = 0.0

    @property
    def working_share(self) -> float:
        return self.working_slot_steps / max(self.slot_steps, 1)


@dataclass
class _Slots:
    """Each slot's state on the device: the token it feeds next, that token's position, the index of the token it
    produces next, its completion (`spare`: none) and whether that completion has ended."""

    token: torch.Tensor
    position: torch.Tensor
    step: torch.Tensor
    completion: torch.Tensor
    done: torch.Tensor


@dataclass
class _Outputs:
    """Every completion's tokens, log-probabilities, count of tokens and stop flag, plus a spare row for the slots
    that have nothing to record; the uniform numbers of every draw."""

    tokens: torch.Tensor
    logps: torch.Tensor
    lengths: torch.Tensor
    stopped: torch.Tensor
    uniforms: torch.Tensor


class Engine:
    """Decodes a list of prompts (equal prompts share one prefill) in `cfg.slots` slots (0: one per completion), in
    lockstep with the other ranks when given one."""

    def __init__(self, model: nn.Module, prompts: Sequence[Sequence[int]], cfg: GenerationConfig,
                 device: torch.device, uniforms: torch.Tensor | None, share_prefill: bool = True,
                 timed: bool = False, lockstep: Lockstep | None = None):
        self.model, self.cfg, self.device, self.timed, self.lockstep = model, cfg, device, timed, lockstep
        self.width = lockstep.multiple if lockstep is not None else 1  # every forward's length divides by it
        self.prompts = [tuple(p) for p in prompts]
        n, new = len(prompts), cfg.max_new_tokens
        self.n_slots = min(cfg.slots or n, n)
        self.capacity = max(map(len, self.prompts)) + new
        self.pending = _groups(self.prompts, share_prefill)  # (group, prompt, its completions not started)
        smallest = min(len(members) for _, _, members in self.pending)
        stage_rows = min(len(self.pending), max(1, self.n_slots // smallest), cfg.prefill_batch or len(self.pending))
        stage_width = -(-max(map(len, self.prompts)) // self.width) * self.width
        self.cache = SlotCache(model.args, self.n_slots, self.capacity, stage_rows, stage_width, device)
        self.scratch: SlotCache | None = None  # an idle prefill's
        self.stops = torch.tensor(cfg.stop_ids or [-1], device=device)
        spare = torch.zeros(1, new)
        drawn = spare.expand(n, new) if uniforms is None else uniforms[:, :new].float().cpu()
        self.out = _Outputs(torch.full((n + 1, new), cfg.pad_id, dtype=torch.long, device=device),
                            torch.zeros(n + 1, new, device=device), torch.zeros(n + 1, dtype=torch.long, device=device),
                            torch.zeros(n + 1, dtype=torch.bool, device=device),
                            torch.cat([drawn, spare]).to(device))
        s = self.n_slots
        self.lead = torch.full((s, self.width - 1), cfg.pad_id, dtype=torch.long, device=device)
        self.state = _Slots(torch.full((s,), cfg.pad_id, dtype=torch.long, device=device),
                            torch.zeros(s, dtype=torch.long, device=device), torch.zeros(s, dtype=torch.long,
                                                                                         device=device),
                            torch.full((s,), n, dtype=torch.long, device=device),
                            torch.ones(s, dtype=torch.bool, device=device))
        self.occupant: list[int | None] = [None] * s  # host-side: completion, position and step of each slot
        self.positions, self.steps = [0] * s, [0] * s
        self.staged: dict[int, tuple[int, int, torch.Tensor]] = {}  # group: staging row, first column, logits
        self.stats = EngineStats()
        self.step = self._step
        if cfg.compile:
            cuda_graphs = "reduce-overhead" if device.type == "cuda" else None
            self.step = torch.compile(self._step, mode=cuda_graphs, fullgraph=True)

    # ------------------------------------------------------------------ the device side

    def _step(self, end: int) -> None:
        """One token for every slot; records a live slot's token and log-probability, marks it done at a stop token
        or max_new_tokens. No host sync."""
        st, out, cfg = self.state, self.out, self.cfg
        new, spare = cfg.max_new_tokens, out.lengths.shape[0] - 1
        tokens = st.token[:, None] if self.width == 1 else torch.cat([self.lead, st.token[:, None]], dim=1)
        view = DecodeView(self.cache, st.position, end, self.width)
        logits = full_tensor(self.model(tokens, cache=view))[:, -1]
        index = st.step.clamp(max=new - 1)
        chosen, probs = choose_with(logits, cfg.sampling, out.uniforms[st.completion, index])
        logps = chosen_logps(logits, chosen, cfg.sampling, probs)
        row = torch.where(st.done, spare, st.completion)
        out.tokens[row, index], out.logps[row, index] = chosen, logps
        stop = torch.isin(chosen, self.stops)
        out.lengths[row], out.stopped[row] = index + 1, stop
        st.done |= stop | (index + 1 >= new)
        st.token.copy_(chosen)
        st.position.copy_((st.position + 1).clamp(max=self.capacity - 1))
        st.step.add_(1)

    def prefill(self, prompts: list[tuple[int, ...]]) -> torch.Tensor:
        """The prompts' keys, values and states into the first staging rows (left-padded to the longest); the logits
        of each one's next token [prompts, vocab]."""
        if self.lockstep is not None:
            self.agree(wants_prefill=True)
        start = self._clock()
        tokens, real = left_padded(prompts, self.cfg.pad_id, self.device, self.width)
        logits = full_tensor(self.model(tokens, cache=PrefillView(self.cache, real, self.width == 1)))[:, -1]
        self.stats.prefill_forwards += 1
        self.stats.prefills += len(prompts)
        self.stats.prefill_tokens += int(tokens.numel())
        self.stats.prefill_s += self._clock() - start
        return logits

    def admit(self, free: list[int]) -> None:
        """Give free slots the next pending completions, the prompts of the groups they reach prefilled together
        (at most stage_rows of them), once per group."""
        while free and self.pending:
            group, prompt, members = self.pending[0]
            if group not in self.staged:
                self.stage(len(free))
            stage_row, start, logits = self.staged[group]
            take, rows = members[:len(free)], free[:len(members)]
            del members[:len(take)], free[:len(take)]
            if not members:
                self.pending.pop(0)
            self.start_completions(take, rows, (stage_row, start, len(prompt)), logits)

    def stage(self, free: int) -> None:
        """Prefill the pending groups `free` slots reach (at most stage_rows), replacing the staging area."""
        groups, reach = [], 0
        for group, prompt, members in self.pending:
            if reach >= free or len(groups) == self.cache.stage_rows:
                break
            groups.append((group, prompt))
            reach += len(members)
        logits = self.prefill([prompt for _, prompt in groups])
        width = max(len(prompt) for _, prompt in groups)
        self.staged = {group: (i, width - len(prompt), logits[i:i + 1]) for i, (group, prompt) in enumerate(groups)}

    def start_completions(self, take: list[int], rows: list[int], staged: tuple[int, int, int],
                          logits: torch.Tensor) -> None:
        """Slots `rows` begin completions `take`: the staged prompt (staging row, first column, length) copied in,
        the first token drawn from its logits [1, vocab]."""
        dev, length = self.device, staged[2]
        c, r = torch.tensor(take, device=dev), torch.tensor(rows, device=dev)
        start = self._clock()
        self.cache.copy_staged(staged[0], r, staged[1], length)
        self.stats.prefill_s += self._clock() - start
        last = logits.expand(len(take), -1)
        out, st, sampling = self.out, self.state, self.cfg.sampling
        chosen, probs = choose_with(last, sampling, out.uniforms[c, 0])
        out.tokens[c, 0], out.logps[c, 0] = chosen, chosen_logps(last, chosen, sampling, probs)
        stop = torch.isin(chosen, self.stops)
        out.lengths[c], out.stopped[c] = 1, stop
        st.token[r], st.position[r], st.step[r], st.completion[r] = chosen, length, 1, c
        st.done[r] = stop | (self.cfg.max_new_tokens <= 1)
        for completion, row in zip(take, rows, strict=True):
            self.occupant[row], self.positions[row], self.steps[row] = completion, length, 1

    # ------------------------------------------------------------------ the host side

    def run(self, on_step: Callable[[float], None] | None = None) -> list[Decoded]:
        begin = time.perf_counter()
        n, every = len(self.prompts), max(self.cfg.stop_check_interval, 1)
        self.admit(list(range(self.n_slots)))
        if self.cfg.compile and self.device.type == "cuda":  # what the CUDA graph reads and writes stays in place
            for t in [*self.cache.tensors(), *vars(self.state).values(), *vars(self.out).values()]:
                torch._dynamo.mark_static_address(t)
        finished = 0
        while True:
            busy, left = self.settle()
            if not busy:
                break
            for _ in range(min(every, left)):
                self.step(self.capacity if self.cfg.compile else self.columns())
                self.stats.decode_steps += 1
                self.stats.slot_steps += self.n_slots
                for row, o in enumerate(self.occupant):
                    if o is not None:
                        self.positions[row] = min(self.positions[row] + 1, self.capacity - 1)
                        self.steps[row] += 1
            finished += self.check()
            if on_step is not None:
                on_step(finished / n)
        decoded = self.results()
        self.stats.working_slot_steps = sum(len(d.tokens) + (d.stopped and not self.cfg.keep_stop) for d in decoded) \
            - n
        self.stats.total_s = time.perf_counter() - begin
        return decoded

    def settle(self) -> tuple[bool, int]:
        """(whether any completion is still decoding, the decode steps until the longest of them reaches
        max_new_tokens): this rank's, or under a lockstep every rank's, once this rank's admissions are made and every
        rank's prefills are run (an idle prefill for each one another rank runs)."""
        new = self.cfg.max_new_tokens
        left = [new - s for o, s in zip(self.occupant, self.steps, strict=True) if o is not None]
        busy, most = bool(left), max(left, default=0)
        if self.lockstep is None:
            return busy, most
        while True:
            prefill, busy_anywhere, most_anywhere = self.agree(False, busy, most)
            if not prefill:
                return busy_anywhere, most_anywhere
            self.idle_prefill()

    def agree(self, wants_prefill: bool, busy: bool = False, left: int = 0) -> list[int]:
        """The lockstep's one all-reduce MAX of (this rank prefills next, has a completion decoding, steps left)."""
        flags = torch.tensor([int(wants_prefill), int(busy), left], device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.lockstep.group)
        return flags.tolist()

    def idle_prefill(self) -> None:
        """A prefill forward of one padding token into a scratch cache: the collectives of another rank's prefill,
        nothing kept."""
        if self.scratch is None:
            self.scratch = SlotCache(self.model.args, 1, self.width, 1, self.width, self.device)
        tokens, real = left_padded([[self.cfg.pad_id]], self.cfg.pad_id, self.device, self.width)
        full_tensor(self.model(tokens, cache=PrefillView(self.scratch, real, self.width == 1)))
        self.stats.idle_prefills += 1

    def check(self) -> int:
        """The host reads which slots are done (one sync), frees them and admits pending completions; returns how
        many completions ended."""
        done = self.state.done.tolist()
        free = [row for row, o in enumerate(self.occupant) if o is None or done[row]]
        ended = sum(self.occupant[row] is not None for row in free)
        for row in free:
            self.occupant[row] = None
        self.admit(free)
        return ended

    def columns(self) -> int:
        used = max((p for p, o in zip(self.positions, self.occupant, strict=True) if o is not None), default=0) + 1
        return min(-(-used // COLUMN_BUCKET) * COLUMN_BUCKET, self.capacity)

    def results(self) -> list[Decoded]:
        n = len(self.prompts)
        tokens, logps = self.out.tokens[:n].tolist(), self.out.logps[:n].tolist()
        lengths, stopped = self.out.lengths[:n].tolist(), self.out.stopped[:n].tolist()
        out = []
        for t, lp, length, stop in zip(tokens, logps, lengths, stopped, strict=True):
            keep = length - (stop and not self.cfg.keep_stop)
            out.append(Decoded(t[:keep], lp[:keep], bool(stop)))
        return out

    def _clock(self) -> float:
        if self.timed and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def _groups(prompts: list[tuple[int, ...]], share: bool) -> list[tuple[int, tuple[int, ...], list[int]]]:
    """The completions of each distinct prompt (in order of first appearance), or one group per completion."""
    if not share:
        return [(i, p, [i]) for i, p in enumerate(prompts)]
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(p, []).append(i)
    return [(g, p, members) for g, (p, members) in enumerate(groups.items())]


@torch.no_grad()
def decode_slots(model: nn.Module, prompts: Sequence[Sequence[int]], cfg: GenerationConfig, device: torch.device,
                 uniforms: torch.Tensor | None = None, on_step: Callable[[float], None] | None = None,
                 share_prefill: bool = True, stats: EngineStats | None = None, timed: bool = False,
                 lockstep: Lockstep | None = None) -> list[Decoded]:
    """decode.sample's rows, decoded by the Engine (`lockstep`: with the ranks whose forwards share collectives;
    None: one process, or ranks that share none); `on_step(fraction)` at every check: the share of completions
    ended; `stats` is filled in when given."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if uniforms is None and not cfg.sampling.greedy:
        uniforms = torch.rand(len(prompts), cfg.max_new_tokens, generator=torch.Generator().manual_seed(cfg.seed))
    was_training = model.training
    model.eval()
    try:
        engine = Engine(model, prompts, cfg, device, uniforms, share_prefill, timed, lockstep)
        if cfg.compile:
            decoded = engine.run(on_step)
        else:  # compiled training blocks run eagerly here: the steps' shapes would recompile them
            with torch.compiler.set_stance("force_eager"):
                decoded = engine.run(on_step)
    finally:
        model.train(was_training)
    if stats is not None:
        for key, value in vars(engine.stats).items():
            setattr(stats, key, value)
    return decoded
