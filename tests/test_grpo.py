"""GRPO against TRL's GRPOTrainer (test-only oracle): on one fixed batch (prompts, completions, rewards of two
functions, one of them None once, and old log-probabilities off the policy's), for loss types dapo, grpo and dr_grpo
with clip-higher, beta with the k3 KL to a reference, the three reward scalings and num_iterations 2, the advantages,
reward metrics, reference log-probabilities, loss, KL, entropy, clip ratios and gradients equal TRL's; and the rewards,
prompt rows and advantages on their own."""

import json
import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.test_preference import perturbed
from titan_lite.checkpoint.hf import write_hf_folder
from titan_lite.config.schema import Grpo
from titan_lite.data.datasets import document_positions
from titan_lite.data.prompts import PromptFile, PromptRow
from titan_lite.errors import ConfigError
from titan_lite.generate import Sampling
from titan_lite.objective.frozen import FrozenForward
from titan_lite.objective.grpo import GRPOLoss, GRPOObjective, completion_units
from titan_lite.rl.advantages import group_advantages, reward_metrics
from titan_lite.rl.rewards import LengthPenalty, Rewards
from titan_lite.rl.rollout import Document, Rollout, microbatch

ATOL = 1e-5
G = 4
TEMPERATURE = 0.7
PROMPT = 5  # every prompt is this long: TRL left-pads prompts, and transformers' positions would count the padding
LENGTHS = [3, 6, 2, 5, 4, 7, 1, 6]  # completion lengths of the 2 prompts x G completions
FIRST = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
SECOND = [0.5, None, 0.2, 0.9, 0.3, 0.3, 0.3, 0.3]  # the second group's is constant but for None: std 0


def fixed_ids(eos: int) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 1500, (PROMPT,), generator=g).tolist() for _ in range(2)]
    completions = [torch.randint(3, 1500, (n,), generator=g).tolist() for n in LENGTHS]
    for i in (0, 2, 4):  # these end at the end token; the others were cut at max_completion_length
        completions[i][-1] = eos
    return prompts, completions


def near_policy(seed: int):
    """The tiny flavor perturbed once (the policy), and a little more with another seed (a reference near it)."""
    model = perturbed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + p.numel())))
    return model


def first_reward(completions, **kwargs):
    return FIRST


def second_reward(completions, **kwargs):
    return SECOND


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Our policy and reference (the tiny flavor, perturbed two ways) and TRL's GRPOTrainer on the same weights."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    from tests.test_chat_workflow import chat_script

    folder = tmp_path_factory.mktemp("trl_grpo")
    tokenizer_folder = chat_script().chat_tokenizer_folder(folder / "tokenizer")
    ours, hf = {}, {}
    for name, seed in (("policy", 3), ("reference", 11)):
        model = near_policy(seed)
        write_hf_folder(dict(model.named_parameters()), model.args, str(folder / name), torch.float32,
                        str(tokenizer_folder))
        ours[name] = model
        hf[name] = transformers.LlamaForCausalLM.from_pretrained(str(folder / name), dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_folder))
    args = GRPOConfig(output_dir=str(folder / "trl"), report_to=[], use_cpu=True, bf16=False, beta=0.04,
                      num_generations=G, per_device_train_batch_size=2 * G, temperature=TEMPERATURE,
                      max_completion_length=max(LENGTHS))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(model=hf["policy"], reward_funcs=[first_reward, second_reward], args=args,
                              processing_class=tokenizer, train_dataset=Dataset.from_list([{"prompt": "a"}]))
    add_fused_lm_head(hf["reference"], temperature=TEMPERATURE)
    trainer.ref_model = hf["reference"].eval()
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return ours, trainer, tokenizer


def trl_rollout(trainer, tokenizer, case: dict) -> tuple[dict, dict]:
    """TRL's scored batch (its own advantages and reference log-probabilities; our old log-probabilities) and
    metrics, for the fixed completions."""
    prompts, completions = fixed_ids(tokenizer.eos_token_id)
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    trainer._generate = lambda _: ([prompts[i // G] for i in range(2 * G)], completions, None, texts, None, {}, None,
                                   None)
    trainer.loss_type, trainer.beta, trainer.scale_rewards = case["loss_type"], case["beta"], case["scale"]
    trainer.epsilon_low, trainer.epsilon_high = case["epsilon"], case["epsilon_high"]
    trainer.num_iterations = case["iterations"]
    trainer.args.use_bias_correction_kl = case.get("kl_ratio", True)
    trainer._metrics["train"].clear()
    with torch.no_grad():
        batch = trainer._generate_and_score_completions([{"prompt": "p"} for _ in range(2 * G)])
        policy, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1), batch["completion_ids"].shape[1])
    noise = 0.3 * torch.randn(policy.shape, generator=torch.Generator().manual_seed(2))
    batch["old_per_token_logps"] = (policy + noise) * batch["completion_mask"]
    return batch, dict(trainer._metrics["train"])


CASES = {
    "dapo_clip_higher": dict(loss_type="dapo", beta=0.0, scale="group", epsilon=0.2, epsilon_high=0.28, iterations=1),
    "grpo_kl_batch": dict(loss_type="grpo", beta=0.04, scale="batch", epsilon=0.2, epsilon_high=0.2, iterations=1),
    "dr_grpo_plain_kl_unscaled_mu2": dict(loss_type="dr_grpo", beta=0.1, scale="none", epsilon=0.1,
                                          epsilon_high=0.3, iterations=2, kl_ratio=False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_grpo_equals_trl(name, models):
    ours, trainer, tokenizer = models
    case = CASES[name]
    batch, trl_metrics = trl_rollout(trainer, tokenizer, case)

    # advantages and reward metrics: TRL's from its _generate_and_score_completions
    scores = torch.tensor([FIRST, [math.nan if v is None else v for v in SECOND]]).T
    totals = (scores * torch.tensor([1.0, 1.0])).nansum(1)
    advantages, zero_std = group_advantages(totals, G, case["scale"])
    torch.testing.assert_close(advantages, batch["advantages"], atol=ATOL, rtol=0)
    metrics = reward_metrics(scores, totals, ["first_reward", "second_reward"], zero_std)
    for key in ("reward", "reward_std", "rewards/first_reward/mean", "rewards/second_reward/mean",
                "rewards/first_reward/std", "frac_reward_zero_std"):
        assert metrics[key] == pytest.approx(trl_metrics[key][0], abs=ATOL), key

    # the loss on our packed microbatch: the rollout with TRL's old log-probabilities as the sampling ones
    prompts, completions = fixed_ids(tokenizer.eos_token_id)
    mask = batch["completion_mask"].bool()
    old = [row[m].tolist() for row, m in zip(batch["old_per_token_logps"], mask, strict=True)]
    rollout = Rollout(prompts, completions, old, advantages.tolist())
    documents = [Document.of(rollout, i, G) for i in [5, 0, 3, 7, 1, 6, 2, 4]]  # packed in another order
    mb = microbatch(documents, 40, packing=True, pad_id=0)
    inputs, labels, docs = mb.inputs, mb.labels, mb.documents
    spec = GRPOLoss(case["loss_type"], case["epsilon"], case["epsilon_high"], case["beta"], TEMPERATURE,
                    max(LENGTHS), case.get("kl_ratio", True))
    policy = ours["policy"]
    policy.zero_grad()
    objective = GRPOObjective(None, spec, FrozenForward([ours["reference"]]))
    prepared = objective.prepare(mb, lambda *t: t)

    def forward(m):
        return m(inputs, positions=document_positions(docs), documents=docs)
    reference = objective.reference(forward, prepared)
    loss = objective.loss_sum(forward(policy), labels, reference, prepared) / completion_units(labels, docs, spec)[0]
    loss.backward()

    trainer.model.zero_grad()
    trl_loss = trainer._compute_loss(trainer.model, batch)
    trl_loss.backward()
    got = objective.metrics(objective.sums)
    assert loss.item() == pytest.approx(trl_loss.item(), abs=ATOL), (loss.item(), trl_loss.item())
    trl_metrics = dict(trainer._metrics["train"])
    names = ["entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]
    for key in names + (["kl"] if case["beta"] else []):
        assert got[key] == pytest.approx(trl_metrics[key][-1], abs=ATOL), (key, got[key], trl_metrics[key])
    assert got["clip_ratio/region_mean"] > 0  # the old log-probabilities are far enough off to clip
    if case["beta"]:  # the reference's log-probabilities at the temperature, token by token
        ref_ours = reference[labels != -100]
        order = [d.index for d in documents]
        ref_trl = torch.cat([batch["ref_per_token_logps"][i][mask[i]] for i in order])
        torch.testing.assert_close(ref_ours, ref_trl, atol=ATOL, rtol=0)
    hf = trainer.model
    torch.testing.assert_close(policy.output.weight.grad, hf.lm_head.weight.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(policy.tok_embeddings.weight.grad, hf.model.embed_tokens.weight.grad, rtol=1e-4,
                               atol=1e-6)


def test_padded_equals_packed():
    """One completion per row, padded, gives the packed microbatch's loss and gradient."""
    model = perturbed(3)
    prompts, completions = fixed_ids(2)
    rollout = Rollout(prompts, completions, [[-1.5] * n for n in LENGTHS], [0.5, -1.0, 0.2, 0.3, -0.1, 0.4, -0.6, 0.3])
    documents = [Document.of(rollout, i, G) for i in range(len(LENGTHS))]
    results = []
    for packing in (True, False):
        model.zero_grad()
        batch = microbatch(documents, 30, packing, pad_id=0, multiple=4)
        inputs, labels, docs = batch.inputs, batch.labels, batch.documents
        assert inputs.shape[0] < len(LENGTHS) if packing else inputs.shape == (len(LENGTHS), 12)
        spec = GRPOLoss("grpo", 0.2, 0.2, 0.0, 1.0, 8)
        objective = GRPOObjective(None, spec, None)
        prepared = objective.prepare(batch, lambda *t: t)
        logits = model(inputs, positions=document_positions(docs), documents=docs)
        loss = objective.loss_sum(logits, labels, None, prepared) / completion_units(labels, docs, spec)[0]
        loss.backward()
        results.append((loss.item(), model.output.weight.grad.clone()))
    assert results[0][0] == pytest.approx(results[1][0], abs=1e-6)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("logprobs", ["sampled", "full"])
def test_training_scores_the_rollouts_distribution(logprobs):
    """A tiny GRPO step on the policy's own samples (temperature 0.7, top k 40, top p 0.8): the training forward's
    log-probabilities equal the rollout's within 1e-5 for both choices, so the first iteration's ratio is 1 (no token
    clipped); "sampled" scores the truncated distribution, above the full one's, and gets a gradient of the same
    magnitude order."""
    from titan_lite.generate import GenerationConfig, sample
    from titan_lite.objective.logps import tempered_logps

    model = perturbed(3)
    prompts, _ = fixed_ids(2)
    cfg = GenerationConfig(max_new_tokens=6, temperature=TEMPERATURE, top_k=40, top_p=0.8, keep_stop=True,
                           logprobs=logprobs)
    uniforms = torch.rand(4, 6, generator=torch.Generator().manual_seed(7))
    decoded = sample(model, [p for p in prompts for _ in range(2)], cfg, torch.device("cpu"), uniforms)
    rollout = Rollout(prompts, [d.tokens for d in decoded], [d.logps for d in decoded], [0.5, -1.0, 0.2, 0.3])
    batch = microbatch([Document.of(rollout, i, 2) for i in range(4)], 30, True, pad_id=0)
    inputs, labels, docs = batch.inputs, batch.labels, batch.documents
    sampled = Sampling(TEMPERATURE, 40, 0.8, logprobs) if logprobs == "sampled" else None
    spec = GRPOLoss("dapo", 0.2, 0.2, 0.0, TEMPERATURE, 6, sampled=sampled)
    objective = GRPOObjective(None, spec, None)
    prepared = objective.prepare(batch, lambda *t: t)
    logits = model(inputs, positions=document_positions(docs), documents=docs)
    trained = labels != -100
    logps, _ = tempered_logps(logits, labels, TEMPERATURE, keep=spec.keep())
    torch.testing.assert_close(logps[trained], prepared.old_logps[trained], atol=1e-5, rtol=0)
    full, _ = tempered_logps(logits, labels, TEMPERATURE)
    if sampled is None:
        assert torch.equal(logps, full)
    else:
        assert (logps[trained] >= full[trained]).all() and (logps[trained] > full[trained] + 1e-3).any()
    loss = objective.loss_sum(logits, labels, None, prepared)
    loss.backward()
    sums = objective.metrics(objective.sums)
    assert sums["clip_ratio/region_mean"] == 0
    assert model.output.weight.grad.abs().sum() > 0


def test_truncated_logps_and_gradient_equal_autograd_of_the_masked_softmax(monkeypatch):
    """tempered_logps with the sampler's mask (top k 7, top p 0.7): log p and d/dlogits equal autograd through
    log_softmax of logits / T with the left-out tokens at -inf (the label kept), in blocks of a few rows."""
    from titan_lite.generate import kept_tokens
    from titan_lite.objective import vocab
    from titan_lite.objective.logps import tempered_logps

    g = torch.Generator().manual_seed(9)
    logits = (3 * torch.randn(2, 9, 50, generator=g)).requires_grad_()
    labels = torch.randint(0, 50, (2, 9), generator=g)
    labels[0, :3] = -100
    weights = torch.randn(2, 9, generator=g)
    s = Sampling(0.7, 7, 0.7, "sampled")
    monkeypatch.setattr(vocab, "CHUNK_ELEMENTS", 4 * 50)
    logps, _ = tempered_logps(logits, labels, 0.7, keep=lambda block: kept_tokens(block, s))
    (grad,) = torch.autograd.grad((logps * weights).sum(), logits)
    x = logits.detach().flatten(0, 1).requires_grad_()
    valid = labels.flatten() != -100
    kept = kept_tokens(x.detach(), s).scatter_(1, labels.flatten().clamp(min=0)[:, None], True)
    direct = torch.log_softmax(x.masked_fill(~kept, float("-inf")) / 0.7, dim=-1)
    direct = direct.gather(1, labels.flatten().clamp(min=0)[:, None]).squeeze(1) * valid
    (direct_grad,) = torch.autograd.grad((direct * weights.flatten()).sum(), x)
    torch.testing.assert_close(logps.flatten(), direct, atol=1e-6, rtol=0)
    torch.testing.assert_close(grad.flatten(0, 1), direct_grad, atol=1e-6, rtol=0)
    assert (kept.sum(dim=1) < 50).all()


# ------------------------------------------------------------------------------------------ rewards and prompts


def rows(*fields: dict) -> list[PromptRow]:
    return [PromptRow("q", f, f"data.jsonl:{i + 1}") for i, f in enumerate(fields)]


def test_builtin_rewards_and_weights():
    cfg = Grpo(reward_funcs=["answer_match", "format", "length_penalty"], reward_weights=[1.0, 0.5, 2.0],
               format_pattern=r"\d", max_completion_length=10, length_penalty_buffer=4)
    rewards = Rewards(cfg)
    scores = rewards.score(rows({"answer": "x\n#### 12"}, {"answer": "#### 3"}), ["so 12", "= 4"],
                           [[1] * 5, [1] * 8])
    assert scores.tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, -0.5]]
    assert rewards.total(scores).tolist() == [1.0, -1.0]
    from trl.rewards import get_soft_overlong_punishment  # the oracle of the length penalty

    lengths = [[0] * n for n in range(13)]
    assert LengthPenalty(10, 4)(lengths) == pytest.approx(get_soft_overlong_punishment(10, 4)(lengths))


def test_user_reward_functions_get_trls_arguments(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def lengths(prompts, completions, completion_ids, solution, **kw):\n"
        "    assert kw['difficulty'] == [1, 2] and prompts == ['q', 'q']\n"
        "    return [len(c) + float(s) for c, s in zip(completions, solution)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = Rewards(Grpo(reward_funcs=["my_rewards:lengths"]))
    assert rewards.names == ["lengths"]
    scored = rewards.score(rows({"solution": "1", "difficulty": 1}, {"solution": "2", "difficulty": 2}), ["ab", "c"],
                           [[1], [2]])
    assert scored.flatten().tolist() == [3.0, 3.0]


def test_prompt_rows_keep_every_field_and_check_messages(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "What is 2+2?", "answer": "4", "level": 1}) + "\n" +
                    json.dumps({"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                                "answer": "5"}) + "\n" +
                    json.dumps({"prompt": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]})
                    + "\n")
    found = PromptFile(Path(data), Grpo(), "training.dataset_path").examples()
    first, second = next(found)[1], next(found)[1]
    assert first == PromptRow("What is 2+2?") and first.fields == {"answer": "4", "level": 1}
    assert second.prompt == (("system", "s"), ("user", "u")) and second.as_reward_input()[1]["content"] == "u"
    with pytest.raises(ConfigError, match=r"p.jsonl:3: 'prompt' must end with a user turn"):
        next(found)


class _Plain:
    """A PromptEncoder stand-in: the prompt's text, no tokens."""

    def encode(self, row):
        return row.prompt, []


def prompt_order(path: Path, state=None, take=20, seed=0, shuffle=True):
    from titan_lite.data.prompts import PromptSource
    source = PromptSource("prompts", PromptFile(path, Grpo(), "training.dataset_path"), _Plain(), seed=seed,
                          shuffle=shuffle)
    stream = source.samples(state)
    return [next(stream) for _ in range(take)]


def test_prompts_shuffle_per_epoch_seeded_and_resume_in_order(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(10)))
    run = prompt_order(data)
    epochs = [[p.index for p, _ in run[:10]], [p.index for p, _ in run[10:]]]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(10))  # each epoch is every prompt once
    assert epochs[0] != epochs[1] and epochs[0] != list(range(10))  # shuffled, and anew each epoch
    assert [p.index for p, _ in prompt_order(data)] == [p.index for p, _ in run]  # the same seed, the same order
    assert [p.index for p, _ in prompt_order(data, seed=1)] != [p.index for p, _ in run]
    state = run[6][1]  # after the 7th prompt: resumed, the rest of the order follows exactly
    assert [p.index for p, _ in prompt_order(data, state, take=13)] == [p.index for p, _ in run[7:]]
    assert [p.index for p, _ in prompt_order(data, shuffle=False, take=10)] == list(range(10))
    # an earlier titan_lite's saved form, (epoch, position) after run[12]: continued at the same prompt
    assert [p.index for p, _ in prompt_order(data, {"epoch": 1, "position": 3}, take=7)] == [
        p.index for p, _ in run[13:]]


# ------------------------------------------------------------------------------------------ bad input, one line


def prompts_file(*rows: dict) -> Callable[[Path], list[str]]:
    def build(tmp: Path) -> list[str]:
        path = tmp / "p.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return ["--training.dataset", "prompts", "--training.dataset_path", str(path)]
    return build


QUESTION = {"prompt": "What is 1 + 1?", "answer": "#### 2"}
BAD_INPUTS = [
    ("a group of one", "'grpo.num_generations' = 1: GRPO compares each completion with the others of its prompt's "
     "group, so it needs at least 2", ["--grpo.num_generations", "1"], QUESTION),
    ("a batch G does not divide", "a step's batch of 8 completions ('training.local_batch_size' 8 x data-parallel "
     "degree 1 x accumulation) is not a multiple of 'grpo.num_generations' = 3", ["--grpo.num_generations", "3"],
     QUESTION),
    ("completions as long as a sequence", "'grpo.max_completion_length' = 64 leaves no room for a prompt in "
     "'training.seq_len' = 64", ["--grpo.max_completion_length", "64"], QUESTION),
    ("a prompt too long for its completions", "{tmp}/p.jsonl:1: the prompt's 10 tokens plus "
     "'grpo.max_completion_length' = 60 exceed 'training.seq_len' = 64 (+ 1)", ["--grpo.max_completion_length", "60"],
     QUESTION),
    ("a reward module that is not there", "reward function 'no_such_rewards:score': module 'no_such_rewards' cannot "
     "be imported (No module named 'no_such_rewards'); a reward module is imported from the folder the run starts in "
     f"({os.getcwd()}) or from PYTHONPATH", ["--grpo.reward_funcs", "no_such_rewards:score"], QUESTION),
    ("a reward function that is not there", "reward function 'tests.grpo_rewards:nope': module 'tests.grpo_rewards' "
     "has no function 'nope'", ["--grpo.reward_funcs", "tests.grpo_rewards:nope"], QUESTION),
    ("a reward name that is neither", "'grpo.reward_funcs' has 'accuracy': not a built-in (answer_match, format, "
     "length_penalty) nor 'module.path:function'", ["--grpo.reward_funcs", "accuracy"], QUESTION),
    ("a prompt without the reward's field", "{tmp}/p.jsonl:1: reward function 'answer_match' needs the field 'answer' "
     "('grpo.answer_field'), which this row lacks (fields: solution)", [], {"prompt": "1 + 1?", "solution": "2"}),
    ("a prompt that is a number", "{tmp}/p.jsonl:1: 'prompt' is int 5, not a string or a message list "
     "('grpo.prompt_field')", [], {"prompt": 5, "answer": "#### 2"}),
    ("an empty prompt", "{tmp}/p.jsonl:2: 'prompt' is empty: there is no problem to answer", [],
     (QUESTION, {"prompt": " ", "answer": "#### 2"})),
    ("a later prompt too long for its completions", "{tmp}/p.jsonl:3: the prompt's 62 tokens plus "
     "'grpo.max_completion_length' = 8 exceed 'training.seq_len' = 64 (+ 1)", [],
     (QUESTION, QUESTION, {"prompt": "one " * 60, "answer": "#### 2"})),
    ("a later row without the reward's field", "{tmp}/p.jsonl:2: reward function 'answer_match' needs the field "
     "'answer'", [], (QUESTION, {"prompt": "1 + 1?", "solution": "2"})),
    ("answers without a number", "{tmp}/p.jsonl:1: reward function 'answer_match' finds no number in the row's "
     "'answer' (\"two\"), nor in any other row's", [], ({"prompt": "1 + 1?", "answer": "two"},) * 2),
    ("a reward function without TRL's signature", "reward function 'tests.grpo_rewards:bare' takes (x), but reward "
     "functions are called by keyword as TRL calls them", ["--grpo.reward_funcs", "tests.grpo_rewards:bare"],
     QUESTION),
    ("prompts from token files", "'training.dataset_path' = '{tmp}/rows_tokens' holds token files, which keep "
     "tokens but not the rows' text and fields", [], "tokens"),
    ("reference base without adapters", "'grpo.reference' = 'base' runs the policy with its adapters switched off as "
     "the reference, but no transform of 'model.converters' = [] keeps a base apart", ["--grpo.beta", "0.1"],
     QUESTION),
    ("a reference without a KL term", "'grpo.reference' = '/somewhere' has no effect: 'grpo.beta' = 0 has no KL term",
     ["--grpo.reference", "/somewhere"], QUESTION),
    ("logprobs neither full nor sampled", "'grpo.logprobs' = 'exact' is not one of: full, sampled",
     ["--grpo.logprobs", "exact"], QUESTION),
    ("sampled logprobs with nothing truncated", "'grpo.logprobs' = 'sampled' has no effect: with 'grpo.top_p' = 1 and "
     "'grpo.top_k' = 0 the sampled distribution is the full one; set top_p < 1 or top_k, or logprobs = 'full'",
     ["--grpo.logprobs", "sampled"], QUESTION),
    ("a stop check interval below 1", "'grpo.stop_check_interval' must be at least 1, got 0",
     ["--grpo.stop_check_interval", "0"], QUESTION),
    ("pipeline parallelism", "'training.dataset' = 'prompts' does not run under pipeline parallelism",
     ["--parallelism.pipeline_parallel_degree", "2"], QUESTION),
    ("grpo settings without prompts", "'grpo.beta' = 0.1 has no effect: [grpo] is read only when 'training.dataset' or "
     "'validation.dataset' is 'prompts'", ["--grpo.beta", "0.1", "--training.dataset", "shakespeare"], None),
]


@pytest.mark.parametrize("name, expected, argv, row", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_bad_grpo_input_is_one_line_exit_2(name, expected, argv, row, tmp_path, monkeypatch, capsys):
    from tests.test_bad_inputs import Case, test_bad_input_is_one_line_exit_2

    build = (token_folder if row == "tokens" else prompts_file(*row) if isinstance(row, tuple) else
             prompts_file(row)) if row is not None else None
    argv = ["--grpo.max_completion_length", "8", *argv] if row is not None else argv
    test_bad_input_is_one_line_exit_2(Case(name, expected, argv, build=build), tmp_path, monkeypatch, capsys)


def token_folder(tmp: Path) -> list[str]:
    """Token files of instruction rows: GRPO needs the rows' text and fields."""
    from tests.test_token_runs import rows_token_folder

    return ["--training.dataset", "prompts", "--training.dataset_path", str(rows_token_folder(tmp))]


def failing(completions, **kwargs):
    if any("boom" in c for c in completions):
        raise ValueError("cannot score this")
    return [0.0] * len(completions)


def test_a_reward_function_that_raises_or_miscounts_is_one_line_naming_it_and_the_row(monkeypatch):
    import tests.test_grpo as here

    rewards = Rewards(Grpo(reward_funcs=["tests.test_grpo:failing"]))
    batch = rows({}, {}, {})
    with pytest.raises(ConfigError, match=r"^reward function 'tests.test_grpo:failing' raised ValueError: cannot score "
                                          r"this \(on the completion of data.jsonl:2\)$"):
        rewards.score(batch, ["fine", "boom", "fine"], [[1], [2], [3]])
    monkeypatch.setattr(here, "failing", lambda completions, **kw: [1.0])
    rewards = Rewards(Grpo(reward_funcs=["tests.test_grpo:failing"]))
    with pytest.raises(ConfigError, match=r"^reward function 'tests.test_grpo:failing' returned 1 values for 3 "
                                          r"completions \(rows data.jsonl:1 to data.jsonl:3\); it must return one"):
        rewards.score(batch, ["a", "b", "c"], [[1], [2], [3]])
    with pytest.raises(ConfigError, match=r"^data.jsonl:2: reward function 'answer_match' needs the field 'answer'"):
        Rewards(Grpo()).score(rows({"answer": "1"}, {}), ["1", "2"], [[1], [2]])


def test_a_non_finite_reward_is_one_line_and_none_stays_missing():
    rewards = Rewards(Grpo(reward_funcs=["tests.grpo_rewards:not_a_number"]))
    with pytest.raises(ConfigError, match=r"^reward function 'tests.grpo_rewards:not_a_number' returned nan for the "
                                          r"completion of data.jsonl:2: a reward must be finite \(return None for a "
                                          r"missing score\)$"):
        rewards.score(rows({}, {}), ["fine", "nan"], [[1], [2]])
    assert Rewards(Grpo(reward_funcs=["tests.grpo_rewards:not_a_number"])).score(rows({}), ["ok"], [[1]]).tolist() \
        == [[1.0]]


def strict(prompts, completions, completion_ids, answer):
    return [1.0] * len(completions)


def test_a_field_a_function_cannot_take_is_one_line_and_unreadable_answers_are_counted(caplog):
    with pytest.raises(ConfigError, match=r"^data.jsonl:1: reward function 'tests.test_grpo:strict' is passed this "
                                          r"row's field 'level' by name .* add \*\*kwargs to it$"):
        Rewards(Grpo(reward_funcs=["tests.test_grpo:strict"])).check_rows(rows({"answer": "1", "level": 2}))
    Rewards(Grpo(reward_funcs=["tests.test_grpo:strict"])).check_rows(rows({"answer": "1"}))
    with caplog.at_level("WARNING", logger="titan_lite"):
        Rewards(Grpo()).check_rows(rows({"answer": "#### 4"}, {"answer": "four"}, {"answer": "x"}, {"answer": "5"}))
    assert [r.getMessage() for r in caplog.records] == [
        "2 of 4 rows' 'answer' hold no number answer_match can read (the first: data.jsonl:2, \"four\"): their "
        "completions score 0 whatever they answer"]


def test_zero_reward_spread_for_three_rollouts_in_a_row_warns_once(caplog):
    from titan_lite.rl.advantages import ZeroSpreadWatch

    watch = ZeroSpreadWatch()
    with caplog.at_level("WARNING", logger="titan_lite"):
        for frac in [1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0]:
            watch.update(frac)
    assert [r.getMessage()[:80] for r in caplog.records] == [
        "grpo: no group's rewards have differed for 3 rollouts in a row (frac_reward_zero"]
