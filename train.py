"""RL for language models with every otb_ref advantage estimator: one process, or torchrun + FSDP2.

    python train.py                                   # tiny random-init decoder learns a copy task on CPU (~1.5 min)
    python train.py --estimator grpo --group-size 4   # any estimator of otb_ref.ESTIMATORS
    python train.py --long-horizon                    # copy task, responses of 64-512 tokens (GPU)
    torchrun --nproc_per_node=8 train.py --model /path/to/hf_model --data /path/train.jsonl --estimator otb
    python plot.py runs/a runs/b                      # reward vs tokens, grad norm vs step

One step: sample prompts -> N responses each (KV cache, temperature, top-p, EOS) -> rewards ->
forward-only old log-probs and sum_v pi_v^2 (otb_ref's chunked LM head) -> advantages (--estimator)
-> clipped policy-gradient loss, normalised by the global token count -> AdamW, warmup + cosine.
Flags, recipes and measured numbers: docs/TRAINING.md.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import importlib.util
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

import parallel
from otb_ref import ESTIMATORS, compute_advantages, logprobs_and_sum_pi_squared, row_grad_norms_sq, variance_proxy_metrics
from otb_ref.losses import AGGREGATIONS, KL_ESTIMATORS, aggregate, clipped_policy_loss, kl_penalty
from otb_ref.rollout import generate, position_ids_from_mask, sampling_uniforms
from otb_ref.static_decode import StaticKVDecoder, static_decode_unsupported
from otb_ref.tasks import SYNTHETIC_TASKS, CharTokenizer, Problem, math_reward, synthetic_problem, synthetic_reward

# ----------------------------------------------------------------------------- config


def _flag(default, help, choices=None, hidden=False):
    return field(default=default, metadata={"help": help, "choices": choices, "hidden": hidden})


@dataclass
class Config:
    steps: int = _flag(300, "RL steps (one batch of prompts each)")
    seed: int = _flag(0, "seed of model init, prompt order and sampling")
    output_dir: str = _flag("", "directory for metrics.jsonl and checkpoints (default: runs/<date-time>)")
    resume: bool = _flag(False, "continue from the newest complete checkpoint in --output-dir (from step 0 if none)")
    save_every: int = _flag(50, "checkpoint every this many steps (and after the last); 0: only after the last")
    keep_checkpoints: int = _flag(2, "complete checkpoints to keep (0: all)")
    model: str = _flag("", "local Hugging Face checkpoint directory (default: a tiny random-init Qwen2)")
    data: str = _flag("", 'JSONL file of {"prompt": ..., "answer": ...} rows, math-answer reward (default: synthetic task)')
    task: str = _flag("copy", "built-in synthetic task when --data is not given", SYNTHETIC_TASKS)
    long_horizon: bool = _flag(False, "copy task with 64-512 token responses and --max-new-tokens 512 (for GPUs)")
    hidden_size: int = _flag(64, "width of the built-in model")
    num_layers: int = _flag(2, "decoder layers of the built-in model")
    prompts_per_step: int = _flag(32, "prompts per step, over all ranks")
    group_size: int = _flag(8, "responses per prompt (N)")
    max_new_tokens: int = _flag(8, "response length cap (default 512 with --long-horizon)")
    temperature: float = _flag(1.0, "sampling temperature (log-probs use the same temperature)")
    top_p: float = _flag(1.0, "nucleus sampling mass")
    estimator: str = _flag("otb", "advantage estimator", tuple(ESTIMATORS))
    leave_one_out: bool = _flag(False, "leave-one-out baselines (unbiased; rloo has it by default)")
    lr: float = _flag(1e-3, "peak learning rate (AdamW)")
    weight_decay: float = _flag(0.0, "AdamW weight decay")
    warmup_steps: int = _flag(5, "linear warmup, in optimizer steps")
    min_lr_ratio: float = _flag(0.1, "cosine decays the learning rate to this fraction of --lr")
    grad_clip: float = _flag(1.0, "clip the global gradient norm to this (0: no clipping)")
    clip_low: float = _flag(0.2, "PPO ratio clip below: 1 - clip_low")
    clip_high: float = _flag(0.2, "PPO ratio clip above: 1 + clip_high")
    loss_agg: str = _flag("token-mean", "loss aggregation", AGGREGATIONS)
    kl_coef: float = _flag(0.0, "weight of the KL loss to the frozen initial policy (0: no reference model)")
    kl_estimator: str = _flag("k3", "per-token KL estimator", KL_ESTIMATORS)
    mini_batches: int = _flag(1, "optimizer steps per RL step (the batch is split into this many)")
    epochs: int = _flag(1, "passes over the batch per RL step")
    micro_batch_size: int = _flag(64, "responses per forward/backward on each rank (gradient accumulation)")
    device: str = _flag("auto", "auto: CUDA when available", ("auto", "cpu", "cuda"))
    mixed_precision: str = _flag("auto", "auto: bf16 parameters (fp32 reductions) on GPU, fp32 on CPU", ("auto", "bf16", "fp32"))
    activation_checkpointing: bool = _flag(False, "recompute decoder-layer activations in backward")
    static_decode: bool = _flag(False, "generate with otb_ref.static_decode (static KV cache, CUDA graphs on GPU; Qwen2/Llama/Qwen3)")
    logprob_chunk_size: int = _flag(0, "rows per chunk of the LM-head log-prob pass (0: library default)")
    tensorboard: bool = _flag(False, "also write TensorBoard scalars (needs the tensorboard package)")
    debug_dump: str = _flag("", "write per-step advantages and rewards of each rank here", hidden=True)
    debug_nan_step: int = _flag(0, "make the loss NaN at this step (tests the skip)", hidden=True)
    debug_stop_after: int = _flag(0, "checkpoint and stop after this step, as if preempted (tests --resume)", hidden=True)


class UserError(Exception):
    """A mistake in flags or files: reported as one line, no traceback."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UserError(message)


def parse_config(argv: list[str]) -> Config:
    parser = _Parser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    for f in dataclasses.fields(Config):
        meta, flag = f.metadata, "--" + f.name.replace("_", "-")
        help = meta["help"] if f.type == "bool" or "default" in meta["help"] else f"{meta['help']} (default: {f.default})"
        help = argparse.SUPPRESS if meta["hidden"] else help
        if f.type == "bool":
            parser.add_argument(flag, action="store_true", help=help)
        else:
            parser.add_argument(flag, type={"int": int, "float": float, "str": str}[f.type], default=f.default, choices=meta["choices"], help=help)
    cfg = Config(**vars(parser.parse_args(argv)))
    if cfg.long_horizon:
        cfg.task = "copy"
        cfg.max_new_tokens = cfg.max_new_tokens if any(a.startswith("--max-new-tokens") for a in argv) else 512
    checks = [
        (cfg.steps >= 1, "--steps must be >= 1"), (cfg.group_size >= 1, "--group-size must be >= 1"),
        (cfg.prompts_per_step >= 1, "--prompts-per-step must be >= 1"), (cfg.max_new_tokens >= 1, "--max-new-tokens must be >= 1"),
        (cfg.temperature > 0, "--temperature must be > 0"), (0 < cfg.top_p <= 1, "--top-p must be in (0, 1]"),
        (cfg.lr > 0, "--lr must be > 0"), (0 <= cfg.clip_low < 1, "--clip-low must be in [0, 1)"),
        (cfg.clip_high >= 0, "--clip-high must be >= 0"), (cfg.kl_coef >= 0, "--kl-coef must be >= 0"),
        (cfg.grad_clip >= 0, "--grad-clip must be >= 0"), (cfg.warmup_steps >= 0, "--warmup-steps must be >= 0"),
        (0 <= cfg.min_lr_ratio <= 1, "--min-lr-ratio must be in [0, 1]"), (cfg.mini_batches >= 1, "--mini-batches must be >= 1"),
        (cfg.epochs >= 1, "--epochs must be >= 1"), (cfg.micro_batch_size >= 1, "--micro-batch-size must be >= 1"),
        (cfg.save_every >= 0, "--save-every must be >= 0"), (cfg.hidden_size >= 32 and cfg.hidden_size % 32 == 0, "--hidden-size must be a positive multiple of 32"),
        (cfg.num_layers >= 1, "--num-layers must be >= 1"), (cfg.logprob_chunk_size >= 0, "--logprob-chunk-size must be >= 0"),
        (not cfg.resume or cfg.output_dir, "--resume needs --output-dir (the run to continue)"),
        (not cfg.model or Path(cfg.model).is_dir(), f"--model {cfg.model}: no such directory"),
        (not cfg.model or (Path(cfg.model) / "config.json").is_file(), f"--model {cfg.model}: no config.json (not a Hugging Face checkpoint directory)"),
        (not cfg.data or Path(cfg.data).is_file(), f"--data {cfg.data}: no such file"),
        (cfg.device != "cuda" or torch.cuda.is_available(), "--device cuda: no CUDA device is available"),
        (not cfg.tensorboard or importlib.util.find_spec("tensorboard"), "--tensorboard needs the tensorboard package (pip install tensorboard)"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)
    return cfg


def load_jsonl(path: str) -> list[Problem]:
    problems = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise UserError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise UserError(f"{path}:{number}: malformed JSON ({error.msg})") from None
        if not isinstance(row, dict) or not {"prompt", "answer"} <= set(row):
            keys = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise UserError(f'{path}:{number}: expected an object with keys "prompt" and "answer", got {keys}')
        if not isinstance(row["prompt"], str) or not isinstance(row["answer"], (str, int, float)):
            raise UserError(f'{path}:{number}: "prompt" must be a string and "answer" a string or number')
        problems.append(Problem(row["prompt"], str(row["answer"])))
    if not problems:
        raise UserError(f"{path}: no rows")
    return problems


# ----------------------------------------------------------------------------- setup


class Policy(nn.Module):
    """A causal LM whose LM head runs inside this module's forward (so FSDP gathers its weight there).

    ``forward(ids, mask, positions, cache=...)`` -> (next-token logits [B, V] fp32, cache);
    ``forward(ids, mask, positions, targets=[B, T])`` -> (log pi(targets), sum pi^2), each [B, T] fp32, for
    the last T positions of ``ids`` (the response), through otb_ref's chunked function.
    """

    def __init__(self, lm: nn.Module, temperature: float, chunk_size: int | None):
        super().__init__()
        self.lm, self.temperature, self.chunk_size = lm, temperature, chunk_size

    def forward(self, input_ids, attention_mask, position_ids, cache=None, targets=None, full_logits=False):
        out = self.lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                    past_key_values=cache, use_cache=targets is None)
        weight = self.lm.get_output_embeddings().weight  # [V, d]
        if targets is None:
            return (out.last_hidden_state[:, -1] @ weight.T).float(), out.past_key_values
        hidden = out.last_hidden_state[:, -targets.shape[1] - 1 : -1]  # position j-1 predicts token j
        if full_logits:  # through the LM-head module, whose call otb_ref.row_grad_norms_sq records: [B, T, V] logits
            z = self.lm.get_output_embeddings()(hidden).float() / self.temperature
            return z.gather(-1, targets[..., None]).squeeze(-1) - z.logsumexp(dim=-1), None
        log_probs, sum_pi_squared = logprobs_and_sum_pi_squared(hidden, weight, targets, temperature=self.temperature, chunk_size=self.chunk_size)
        return log_probs.clone(), sum_pi_squared.clone()  # fresh tensors, not views: FSDP hooks its outputs


def build_model_and_tokenizer(cfg: Config):
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    if not cfg.model:
        tokenizer = CharTokenizer()
        config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=4 * cfg.hidden_size,
                             num_hidden_layers=cfg.num_layers, num_attention_heads=max(1, cfg.hidden_size // 16),
                             num_key_value_heads=max(1, cfg.hidden_size // 32), max_position_embeddings=2048,
                             tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None)
        torch.manual_seed(cfg.seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32), tokenizer, [tokenizer.eos_token_id], tokenizer.pad_token_id
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        lm = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    except Exception as error:  # noqa: BLE001 - any loading failure is the user's checkpoint
        raise UserError(f"--model {cfg.model}: not a loadable Hugging Face checkpoint ({type(error).__name__}: {str(error).splitlines()[0]})") from None
    head = lm.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None or getattr(lm.config, "final_logit_softcapping", None) \
            or getattr(lm.config, "logit_scale", None) not in (None, 1.0):
        raise UserError(f"--model {cfg.model}: unsupported LM head (logits must be hidden @ W.T: no bias, soft-capping or scaling)")
    eos = lm.generation_config.eos_token_id if lm.generation_config.eos_token_id is not None else tokenizer.eos_token_id
    eos = sorted({*(eos if isinstance(eos, list) else [eos]), tokenizer.eos_token_id} - {None})
    if not eos:
        raise UserError(f"--model {cfg.model}: the tokenizer has no EOS token")
    return lm, tokenizer, eos, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    if isinstance(tokenizer, CharTokenizer):
        return tokenizer.encode(prompt)
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


@functools.lru_cache(maxsize=2)
def _epoch_order(seed: int, epoch: int, size: int) -> list[int]:
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()


def problem_at(cfg: Config, data: list[Problem] | None, position: int) -> Problem:
    """Problem number ``position`` of the run's stream (a pure function of seed and position, so a
    resumed run continues where it stopped): synthetic, or the data in a new shuffled order each epoch."""
    if data is None:
        return synthetic_problem(cfg.task, cfg.seed, position, copy_lengths=(63, 511) if cfg.long_horizon else (1, 4))
    epoch, offset = divmod(position, len(data))
    return data[_epoch_order(cfg.seed, epoch, len(data))[offset]]


def exact_energies(estimator: str, lm: nn.Module, sequences, attention, mask, temperature: float) -> dict[str, torch.Tensor]:
    """Exact ``||S||²`` [B] ("eob") or ``||S_t||²`` [B, T] ("otb_exact") of an unsharded ``lm`` (otb_ref.exact).

    otb_ref.exact uses the model's default positions 0..L-1, so each row is rotated to move its left
    padding to the end: then its real tokens sit at the same positions as in the policy's forward.
    """
    from otb_ref.exact import prefix_grad_norms_sq, sequence_grad_norms_sq

    num_prompt = sequences.shape[1] - mask.shape[1]
    left_pad = (~attention[:, :num_prompt]).sum(dim=1, keepdim=True)  # [B, 1]
    index = (torch.arange(sequences.shape[1], device=sequences.device) + left_pad) % sequences.shape[1]  # rotated[:, i] = row[:, index[:, i]]
    response = torch.cat([torch.zeros_like(attention[:, :num_prompt]), mask], dim=1)
    args = [lm] + [x.gather(1, index).long() for x in (sequences, response, attention)]
    if ESTIMATORS[estimator].granularity == "sequence":
        return {"grad_norms_sq": sequence_grad_norms_sq(*args, temperature=temperature).float()}
    rotated = prefix_grad_norms_sq(*args, temperature=temperature)  # [B, L] on the rotated grid
    return {"cumulative_energy": torch.zeros_like(rotated).scatter_(1, index, rotated)[:, num_prompt:].float()}


def sequence_norms(policy: nn.Module, sequences, attention, positions, response_ids, mask) -> torch.Tensor:
    """``||S_i||² = ||∇_θ Σ_t m_it log π(y_it)||²`` [B] for the rows given, in one forward + backward of the
    (possibly sharded) policy: otb_ref.row_grad_norms_sq on the policy's own forward and positions."""
    def log_likelihood():  # [B]
        log_probs, _ = policy(sequences, attention, positions, targets=response_ids, full_logits=True)
        return (log_probs * mask).sum(dim=1)

    return row_grad_norms_sq(policy, log_likelihood)


def local_prompt_positions(cfg: Config, env: parallel.Dist) -> list[int]:
    """This rank's prompts within the step, ordered by mini-batch: mini-batch k holds the same
    global prompts for any world size (rank r takes the r-th slice of each)."""
    per_mini = cfg.prompts_per_step // cfg.mini_batches
    per_rank = per_mini // env.world_size
    return [k * per_mini + env.rank * per_rank + i for k in range(cfg.mini_batches) for i in range(per_rank)]


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(sys.argv[1:] if argv is None else argv)
    data = load_jsonl(cfg.data) if cfg.data else None
    env = parallel.init(cfg.device)
    try:
        train(cfg, data, env)
    finally:
        parallel.shutdown()


def train(cfg: Config, data: list[Problem] | None, env: parallel.Dist) -> None:
    from tqdm import tqdm

    if cfg.prompts_per_step % (env.world_size * cfg.mini_batches):
        raise UserError(f"--prompts-per-step ({cfg.prompts_per_step}) must be divisible by the number of ranks ({env.world_size}) times --mini-batches ({cfg.mini_batches})")
    output_dir = Path(cfg.output_dir or parallel.broadcast_object(time.strftime("runs/%Y%m%d-%H%M%S")))
    if not cfg.resume and ((output_dir / "metrics.jsonl").exists() or (output_dir / "checkpoints").exists()):
        raise UserError(f"--output-dir {output_dir} already holds a run: pass --resume to continue it, or choose another directory")
    parallel.barrier()  # every rank has looked before rank 0 writes anything there
    lm, tokenizer, eos_ids, pad_id = build_model_and_tokenizer(cfg)
    lm.eval()  # no dropout in RL: generation, old log-probs and the loss see the same function
    on_gpu = env.device.type == "cuda"
    bf16 = cfg.mixed_precision == "bf16" or (cfg.mixed_precision == "auto" and on_gpu)
    # "otb_exact" needs ||S_t||^2 at every token: otb_ref.exact on a full copy (small models only). "eob" needs
    # ||S||^2 per response: one forward + backward of the sharded policy itself (otb_ref.row_grad_norms_sq).
    exact_lm = copy.deepcopy(lm).to(env.device) if cfg.estimator == "otb_exact" else None
    ref_lm = copy.deepcopy(lm).requires_grad_(False) if cfg.kl_coef > 0 else None  # frozen initial policy
    chunk = cfg.logprob_chunk_size or None

    def sharded(model: nn.Module, checkpointing: bool) -> nn.Module:
        layers = [m for m in model.modules() if type(m).__name__ in (getattr(model, "_no_split_modules", None) or ())]
        # fully_shard moves each unit to the device as it shards it: no full copy of the model on one GPU.
        return parallel.shard(Policy(model, cfg.temperature, chunk), layers, env, bf16=bf16, activation_checkpointing=checkpointing)

    if cfg.static_decode and (why := static_decode_unsupported(lm)):
        raise UserError(f"--static-decode: {why}")
    policy = sharded(lm, cfg.activation_checkpointing)
    reference = sharded(ref_lm, False) if ref_lm is not None else None
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999))
    total_updates = cfg.steps * cfg.mini_batches * cfg.epochs

    def lr_factor(update: int) -> float:  # linear warmup, then cosine to min_lr_ratio
        if update < cfg.warmup_steps:
            return (update + 1) / (cfg.warmup_steps + 1)
        progress = (update - cfg.warmup_steps) / max(1, total_updates - cfg.warmup_steps)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    state = {"step": 0, "tokens": 0, "skipped_total": 0, "data_position": 0, "scheduler": scheduler.state_dict()}
    latest = parallel.latest_checkpoint(output_dir) if cfg.resume else None
    if latest is not None:
        state = parallel.load_checkpoint(latest, policy, optimizer, state, env)
        scheduler.load_state_dict(state["scheduler"])
    if env.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
        print(f"run {output_dir}: {env.world_size} rank(s) on {env.device}, estimator {cfg.estimator}, "
              + (f"resumed from {latest.name}" if latest else "from scratch" + (" (no complete checkpoint found)" if cfg.resume else "")), file=sys.stderr)
    log = parallel.MetricsLog(output_dir, env, resume_step=state["step"] if cfg.resume else None, tensorboard=cfg.tensorboard)
    prompt_positions = local_prompt_positions(cfg, env)
    n = cfg.group_size
    global_rows = torch.tensor([p * n + i for p in prompt_positions for i in range(n)])  # this rank's rows of the global batch
    rows_per_mini = len(global_rows) // cfg.mini_batches
    progress = tqdm(total=cfg.steps, initial=state["step"], disable=not env.is_main, desc="train", dynamic_ncols=True)

    def sync():
        if on_gpu:
            torch.cuda.synchronize()
        return time.perf_counter()

    for step in range(state["step"] + 1, cfg.steps + 1):
        # ------------------------------------------------------------------------- rollout
        t0 = sync()
        problems = [problem_at(cfg, data, state["data_position"] + p) for p in range(cfg.prompts_per_step)]
        encoded = [encode_prompt(tokenizer, problem.prompt) for problem in problems]
        prompt_len = max(len(ids) for ids in encoded)  # pad to the GLOBAL longest: the same layout on any world size
        prompt_ids = torch.tensor([[pad_id] * (prompt_len - len(encoded[p])) + encoded[p] for p in prompt_positions for _ in range(n)])
        prompt_mask = torch.tensor([[0] * (prompt_len - len(encoded[p])) + [1] * len(encoded[p]) for p in prompt_positions for _ in range(n)])
        prompt_ids, prompt_mask = prompt_ids.to(env.device), prompt_mask.to(env.device)
        uniforms = sampling_uniforms(cfg.seed, step, cfg.prompts_per_step * n, cfg.max_new_tokens)[global_rows].to(env.device)
        with parallel.gathered_for_generation(policy):
            decoder = StaticKVDecoder(policy, policy.lm, cfg.max_new_tokens) if cfg.static_decode else policy
            rollout = generate(decoder, prompt_ids, prompt_mask, uniforms, eos_token_ids=eos_ids, pad_token_id=pad_id,
                               max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, keep_going=parallel.any_rank)
        response_ids, mask = rollout.response_ids, rollout.response_mask
        lengths = mask.sum(dim=1)  # [B] >= 1
        texts = [tokenizer.decode(row[: int(length)].tolist(), skip_special_tokens=True) for row, length in zip(response_ids.cpu(), lengths.cpu())]
        answers = [problems[p].answer for p in prompt_positions for _ in range(n)]
        finished = rollout.finished.cpu().tolist()
        if data is None:
            scores = [synthetic_reward(cfg.task, text, answer, done) for text, answer, done in zip(texts, answers, finished)]
        else:
            scores = [math_reward(text, answer) for text, answer in zip(texts, answers)]
        scores = torch.tensor(scores, dtype=torch.float32, device=env.device)
        rewards = torch.zeros(mask.shape, dtype=torch.float32, device=env.device).scatter_(1, (lengths - 1)[:, None], scores[:, None])
        sequences = torch.cat([prompt_ids, response_ids], dim=1)
        attention = torch.cat([prompt_mask.bool(), mask], dim=1)
        positions = position_ids_from_mask(attention)
        t1 = sync()

        # ------------------------------------------------------------------------- old log-probs, advantages
        micro = [slice(start, min(start + cfg.micro_batch_size, (k + 1) * rows_per_mini))  # micro-batches never straddle mini-batches
                 for k in range(cfg.mini_batches) for start in range(k * rows_per_mini, (k + 1) * rows_per_mini, cfg.micro_batch_size)]
        old_log_probs, sum_pi_sq = torch.empty(mask.shape, device=env.device), torch.empty(mask.shape, device=env.device)
        ref_log_probs = torch.empty(mask.shape, device=env.device) if reference is not None else None
        with torch.no_grad():
            for rows in micro:
                args = (sequences[rows], attention[rows], positions[rows])
                old_log_probs[rows], sum_pi_sq[rows] = policy(*args, targets=response_ids[rows])
                if reference is not None:
                    ref_log_probs[rows] = reference(*args, targets=response_ids[rows])[0]
        t2 = sync()
        energies = {}
        if cfg.estimator == "eob":  # ||S||^2 of every response, micro-batch by micro-batch; no .grad is touched
            energies["grad_norms_sq"] = torch.cat([sequence_norms(policy, sequences[r], attention[r], positions[r],
                                                                  response_ids[r], mask[r]) for r in micro])
        if exact_lm is not None:  # the full parameters every step (one all-gather of the whole model: small models only)
            exact_lm.load_state_dict({k.removeprefix("lm."): v for k, v in parallel.full_model_state_dict(policy).items()})
            energies = exact_energies(cfg.estimator, exact_lm, sequences, attention, mask, cfg.temperature)
        group = torch.tensor([p for p in prompt_positions for _ in range(n)], device=env.device)  # prompt ids
        advantages, _ = compute_advantages(cfg.estimator, rewards, mask, group, old_log_probs=old_log_probs, sum_pi_squared=sum_pi_sq,
                                           leave_one_out=True if cfg.leave_one_out else None, **energies)
        proxy = variance_proxy_metrics(advantages, mask, old_log_probs, sum_pi_sq)
        if cfg.debug_dump:
            Path(cfg.debug_dump).mkdir(parents=True, exist_ok=True)
            torch.save({"rows": global_rows, "advantages": advantages.cpu(), "rewards": scores.cpu(), "response_ids": response_ids.cpu()},
                       Path(cfg.debug_dump) / f"step{step}_rank{env.rank}.pt")
        t3 = sync()

        # ------------------------------------------------------------------------- update
        # Per optimizer step: the loss is the sum of micro-batch shares normalised by GLOBAL counts, and
        # FSDP sums (not averages) gradients over ranks, so any rank/micro-batch split gives the same gradient.
        totals = dict.fromkeys(["loss", "grad_norm", "clip_fraction", "approx_kl", "kl_ref"], 0.0)
        skipped, lr = 0, scheduler.get_last_lr()[0]
        for _ in range(cfg.epochs):
            for k in range(cfg.mini_batches):
                mini = slice(k * rows_per_mini, (k + 1) * rows_per_mini)
                global_tokens = float(parallel.all_reduce([float(mask[mini].sum())])[0])
                norm = dict(global_tokens=global_tokens, global_sequences=rows_per_mini * env.world_size)
                local = torch.zeros(4, dtype=torch.float64)  # loss, clipped-token fraction, approx-KL, KL to reference
                for rows in (r for r in micro if mini.start <= r.start < mini.stop):
                    log_probs, _ = policy(sequences[rows], attention[rows], positions[rows], targets=response_ids[rows])
                    loss, stats = clipped_policy_loss(log_probs, old_log_probs[rows], advantages[rows], mask[rows], clip_low=cfg.clip_low,
                                                      clip_high=cfg.clip_high, aggregation=cfg.loss_agg, **norm)
                    if reference is not None:
                        kl = kl_penalty(log_probs, ref_log_probs[rows], cfg.kl_estimator)
                        loss = loss + cfg.kl_coef * aggregate(kl, mask[rows], cfg.loss_agg, **norm)
                        local[3] += float(aggregate(kl.detach(), mask[rows], "token-mean", **norm))
                    if step == cfg.debug_nan_step:
                        loss = loss * float("nan")
                    loss.backward()
                    local += torch.tensor([float(loss.detach()), float(stats["clipped_tokens"]) / global_tokens,
                                           float(stats["approx_kl_sum"]) / global_tokens, 0.0], dtype=torch.float64)
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
                grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)  # global norm
                local = parallel.all_reduce(local)
                if math.isfinite(grad_norm) and math.isfinite(float(local[0])):
                    optimizer.step()
                else:  # every rank sees the same global values, so all skip together
                    skipped += 1
                    if env.is_main:
                        progress.write(f"step {step}: non-finite loss ({float(local[0])}) or gradient norm ({grad_norm}); update skipped", file=sys.stderr)
                optimizer.zero_grad(set_to_none=True)
                lr = scheduler.get_last_lr()[0]
                scheduler.step()
                for key, value in zip(["loss", "clip_fraction", "approx_kl", "kl_ref"], local.tolist()):
                    totals[key] += value
                totals["grad_norm"] += grad_norm
        t4 = sync()

        # ------------------------------------------------------------------------- logging, checkpoint
        updates, count = cfg.mini_batches * cfg.epochs, cfg.prompts_per_step * n
        sums = parallel.all_reduce([float(scores.sum()), float(scores.square().sum()), float(lengths.sum()), float((~rollout.finished).sum()),
                                    *(proxy[f"variance_proxy/{key}"] for key in ("proxy2_total_power", "expected_a_squared", "expected_w"))]).tolist()
        reward_sum, reward_sq_sum, generated, truncated, power, a_squared, energy = sums
        power, grad_norm_mean = power / env.world_size, totals["grad_norm"] / updates  # ranks hold equal row counts: mean of means
        state.update(step=step, tokens=state["tokens"] + int(generated), skipped_total=state["skipped_total"] + skipped,
                     data_position=state["data_position"] + cfg.prompts_per_step, scheduler=scheduler.state_dict())
        record = {
            "step": step, "tokens": state["tokens"], "reward_mean": reward_sum / count,
            "reward_std": math.sqrt(max(0.0, reward_sq_sum / count - (reward_sum / count) ** 2)),
            "response_length_mean": generated / count, "response_length_max": int(parallel.all_reduce([float(lengths.max())], op="max")[0]),
            "truncated_fraction": truncated / count, "loss": totals["loss"] / updates, "grad_norm": grad_norm_mean, "lr": lr,
            "clip_fraction": totals["clip_fraction"] / updates, "approx_kl": totals["approx_kl"] / updates,
            "skipped": skipped, "skipped_total": state["skipped_total"],
            # THEORY §5 over the global batch: signal = ||g||², total power P, noise = (P - signal) / (B - 1).
            "variance_proxy/proxy1_signal_strength": grad_norm_mean**2, "variance_proxy/proxy2_total_power": power,
            "variance_proxy/proxy3_pure_noise": max(0.0, (power - grad_norm_mean**2) / (count - 1)) if count > 1 else 0.0,
            "variance_proxy/expected_a_squared": a_squared / env.world_size, "variance_proxy/expected_w": energy / env.world_size,
            "time/rollout": t1 - t0, "time/logprobs": t2 - t1, "time/advantages": t3 - t2, "time/update": t4 - t3, "time/step": t4 - t0,
            "throughput/generation_tokens_per_s": generated / (t1 - t0), "throughput/update_tokens_per_s": generated * cfg.epochs / (t4 - t3),
        }
        if reference is not None:
            record["kl_ref"] = totals["kl_ref"] / updates
        log.write(record)
        progress.set_postfix(reward=f"{record['reward_mean']:.2f}", len=f"{record['response_length_mean']:.1f}", refresh=False)
        progress.update(1)
        if step in (cfg.steps, cfg.debug_stop_after) or (cfg.save_every and step % cfg.save_every == 0):
            parallel.save_checkpoint(output_dir, step, policy, optimizer, state, env, cfg.keep_checkpoints)
        if step == cfg.debug_stop_after:
            break
    progress.close()


if __name__ == "__main__":
    try:
        main()
    except UserError as error:
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank finds the same mistake: rank 0 reports it
            print(f"train.py: error: {error}", file=sys.stderr)
        sys.exit(2)
