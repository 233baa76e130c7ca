"""RL for language models with every otb_ref advantage estimator: one process, or torchrun + FSDP2.

    python train.py                                   # tiny random-init decoder learns a copy task on CPU (~1.5 min)
    python train.py --estimator grpo --group-size 4   # any estimator of otb_ref.ESTIMATORS
    python train.py --long-horizon                    # copy task, responses of 64-512 tokens (GPU)
    torchrun --nproc_per_node=8 train.py --model /path/to/hf_model --data /path/train.jsonl --estimator otb
    python train.py --output-dir runs/a --resume      # continue a run from its newest complete checkpoint
    python plot.py runs/a runs/b                      # reward vs tokens, grad norm vs step

One step, one function each: rollout (prompts -> N responses each, KV cache) -> score (rewards) ->
advantages (old log-probs and sum_v pi_v^2 from otb_ref's chunked LM head, then --estimator) ->
update (clipped policy-gradient loss / global token count, AdamW, warmup + cosine) -> log and checkpoint.
Flags, recipes and measured numbers: docs/TRAINING.md.
"""

from __future__ import annotations

import copy
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from otb_ref import ESTIMATORS, compute_advantages, variance_proxy_metrics
from otb_train import checkpoints, distributed
from otb_train.config import (
    Config,
    UserError,
    check_run_directory,
    config_record,
    describe,
    parse_config,
)
from otb_train.data import check_prompts, encode_prompt, left_pad, load_jsonl, problem_at
from otb_train.energies import exact_energies, sequence_norms
from otb_train.losses import aggregate, clipped_policy_loss, kl_penalty
from otb_train.model import build_model_and_tokenizer, shard_policy
from otb_train.rollout import generate, position_ids_from_mask, sampling_uniforms
from otb_train.run_log import JsonlLog, record_configuration
from otb_train.static_decode import StaticKVDecoder, static_decode_unsupported
from otb_train.tasks import Problem, math_reward, synthetic_reward

# ----------------------------------------------------------------------------- what the phases share


@dataclass
class Run:
    """The configuration, this rank and the models: everything a phase reads besides the batch."""

    cfg: Config
    env: distributed.Dist
    output_dir: Path
    data: list[Problem] | None
    tokenizer: object
    eos_ids: list[int]
    pad_id: int
    policy: nn.Module  # FSDP2-sharded Policy
    reference: nn.Module | None  # frozen initial policy (--kl-coef > 0)
    exact_lm: nn.Module | None  # unsharded copy for otb_ref.exact (--estimator otb_exact)
    optimizer: torch.optim.Optimizer
    schedule_steps: int  # the LR schedule's horizon: --steps of the run's first start
    prompt_positions: list[int]  # this rank's prompts within a step
    global_rows: torch.Tensor  # [B] this rank's rows of the step's global batch
    micro: list[slice]  # micro-batches of this rank's rows; none straddles a mini-batch
    parameters: int  # the policy's parameter count (all ranks): 6 x this x tokens is the update's model FLOPs
    metrics_log: JsonlLog | None = None
    samples_log: JsonlLog | None = None
    progress: object = None
    last_truncation_warning: int = -(10**9)


@dataclass
class Batch:
    """One step's rows on this rank, filled phase by phase. B rows (prompts x N), P prompt + T response columns."""

    problems: list[Problem]  # this rank's prompts, one per group
    group: torch.Tensor  # [B] prompt index of each row; equal ids form a group
    sequences: torch.Tensor  # [B, P+T] left-padded prompt, then the response
    attention: torch.Tensor  # [B, P+T] bool
    positions: torch.Tensor  # [B, P+T] position ids
    response_ids: torch.Tensor  # [B, T], pad after EOS
    mask: torch.Tensor  # [B, T] bool, True on generated tokens (EOS included)
    finished: torch.Tensor  # [B] bool, the response ended with EOS
    texts: list[str] = field(default_factory=list)  # score: B decoded responses
    scores: torch.Tensor | None = None  # score: [B] outcome rewards
    rewards: torch.Tensor | None = None  # score: [B, T] the outcome reward on the last response token
    old_log_probs: torch.Tensor | None = None  # logprobs: [B, T] log pi_old(y_t)
    sum_pi_squared: torch.Tensor | None = None  # logprobs: [B, T] sum_v pi_old(v)^2
    ref_log_probs: torch.Tensor | None = None  # logprobs: [B, T] log pi_ref(y_t) (--kl-coef > 0)
    advantages: torch.Tensor | None = None  # advantages: [B, T]
    proxy: dict[str, float] = field(default_factory=dict)  # advantages: otb_ref.variance_proxy_metrics


def local_prompt_positions(cfg: Config, env: distributed.Dist) -> list[int]:
    """This rank's prompts within the step, ordered by mini-batch: mini-batch k holds the same
    global prompts for any world size (rank r takes the r-th slice of each)."""
    per_mini = cfg.prompts_per_step // cfg.mini_batches
    per_rank = per_mini // env.world_size
    return [k * per_mini + env.rank * per_rank + i for k in range(cfg.mini_batches) for i in range(per_rank)]


# ----------------------------------------------------------------------------- the phases of one step


def rollout(run: Run, step: int, data_position: int) -> Batch:
    """Take the step's prompts from the stream and sample --group-size responses to each (KV cache)."""
    cfg, env, n = run.cfg, run.env, run.cfg.group_size
    problems = [problem_at(cfg, run.data, data_position + p) for p in range(cfg.prompts_per_step)]
    encoded = [encode_prompt(run.tokenizer, problem.prompt) for problem in problems]
    width = max(len(ids) for ids in encoded)  # pad to the GLOBAL longest: the same layout on any world size
    rows = [encoded[p] for p in run.prompt_positions for _ in range(n)]
    prompt_ids, prompt_mask = left_pad(rows, run.pad_id, width, env.device)
    uniforms = sampling_uniforms(cfg.seed, step, cfg.prompts_per_step * n, cfg.max_new_tokens)[run.global_rows]
    with distributed.gathered_for_generation(run.policy):
        decoder = StaticKVDecoder(run.policy, run.policy.lm, cfg.max_new_tokens) if cfg.static_decode else run.policy
        out = generate(
            decoder,
            prompt_ids,
            prompt_mask,
            uniforms.to(env.device),
            eos_token_ids=run.eos_ids,
            pad_token_id=run.pad_id,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            keep_going=distributed.any_rank,
            drop_finished=cfg.drop_finished_rows,
        )
    attention = torch.cat([prompt_mask.bool(), out.response_mask], dim=1)
    return Batch(
        problems=[problems[p] for p in run.prompt_positions],
        group=_group_ids(run, n),
        sequences=torch.cat([prompt_ids, out.response_ids], dim=1),
        attention=attention,
        positions=position_ids_from_mask(attention),
        response_ids=out.response_ids,
        mask=out.response_mask,
        finished=out.finished,
    )


def _group_ids(run: Run, n: int) -> torch.Tensor:
    """Each response's group: its prompt's position (N responses per group), or its own row with --no-baseline."""
    if run.cfg.no_baseline:  # distinct ids across ranks: the global row numbers
        return run.global_rows.to(run.env.device)
    return torch.tensor([p for p in run.prompt_positions for _ in range(n)], device=run.env.device)


def score(run: Run, batch: Batch) -> None:
    """Decode the responses and reward them: the synthetic task's reward, or the math verifier for --data."""
    cfg, n = run.cfg, run.cfg.group_size
    lengths = batch.mask.sum(dim=1)  # [B] >= 1
    rows = zip(batch.response_ids.cpu(), lengths.cpu())
    batch.texts = [run.tokenizer.decode(row[: int(length)].tolist(), skip_special_tokens=True) for row, length in rows]
    answers = [problem.answer for problem in batch.problems for _ in range(n)]
    if run.data is None:
        finished = batch.finished.cpu().tolist()
        scores = [synthetic_reward(cfg.task, *row) for row in zip(batch.texts, answers, finished)]
    else:
        scores = [math_reward(text, answer) for text, answer in zip(batch.texts, answers)]
    batch.scores = torch.tensor(scores, dtype=torch.float32, device=run.env.device)
    rewards = torch.zeros(batch.mask.shape, dtype=torch.float32, device=run.env.device)
    batch.rewards = rewards.scatter_(1, (lengths - 1)[:, None], batch.scores[:, None])


def old_log_probs(run: Run, batch: Batch) -> None:
    """Forward only, micro-batch by micro-batch: log pi_old(y_t) and sum_v pi_old(v)^2 (and log pi_ref(y_t))."""
    shape, device = batch.mask.shape, run.env.device
    batch.old_log_probs, batch.sum_pi_squared = torch.empty(shape, device=device), torch.empty(shape, device=device)
    batch.ref_log_probs = torch.empty(shape, device=device) if run.reference is not None else None
    with torch.no_grad():
        for rows in run.micro:
            args = (batch.sequences[rows], batch.attention[rows], batch.positions[rows])
            batch.old_log_probs[rows], batch.sum_pi_squared[rows] = run.policy(*args, targets=batch.response_ids[rows])
            if run.reference is not None:
                batch.ref_log_probs[rows] = run.reference(*args, targets=batch.response_ids[rows])[0]


def estimate_advantages(run: Run, batch: Batch) -> None:
    """otb_ref.compute_advantages(--estimator), with exact gradient energies for eob and otb_exact."""
    cfg, b = run.cfg, batch
    energies = {}
    # ||S||^2 of every response ("eob"), micro-batch by micro-batch; no .grad is touched
    if "grad_norms_sq" in ESTIMATORS[cfg.estimator].inputs:
        norms = [
            sequence_norms(run.policy, b.sequences[r], b.attention[r], b.positions[r], b.response_ids[r], b.mask[r])
            for r in run.micro
        ]
        energies["grad_norms_sq"] = torch.cat(norms)
    if run.exact_lm is not None:  # the full parameters every step (one all-gather of the whole model: small models)
        full = distributed.full_model_state_dict(run.policy)
        run.exact_lm.load_state_dict({k.removeprefix("lm."): v for k, v in full.items()})
        energies = exact_energies(cfg.estimator, run.exact_lm, b.sequences, b.attention, b.mask, cfg.temperature)
    b.advantages, _ = compute_advantages(
        cfg.estimator,
        b.rewards,
        b.mask,
        b.group,
        old_log_probs=b.old_log_probs,
        sum_pi_squared=b.sum_pi_squared,
        leave_one_out=cfg.leave_one_out,
        std_normalize=cfg.std_normalize,
        **energies,
    )
    b.proxy = variance_proxy_metrics(b.advantages, b.mask, b.old_log_probs, b.sum_pi_squared)


def learning_rate(cfg: Config, updates_done: int, tokens: int, schedule_steps: int) -> float:
    """Linear warmup over --warmup-steps optimizer steps, then a cosine from --lr down to --min-lr-ratio x --lr.

    Cosine progress: generated tokens before this step / --token-budget; without a budget, optimizer steps /
    (schedule_steps x updates per step), where schedule_steps is --steps of the run's FIRST start. A resumed
    run with a larger --steps therefore keeps its schedule and runs the extra steps at --min-lr-ratio x --lr.
    """
    if updates_done < cfg.warmup_steps:
        return cfg.lr * ((updates_done + 1) / (cfg.warmup_steps + 1))
    if cfg.token_budget:
        progress = tokens / cfg.token_budget
    else:
        total = schedule_steps * cfg.mini_batches * cfg.epochs
        progress = (updates_done - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def accumulate_gradients(run: Run, batch: Batch, mini: slice) -> dict[str, float]:
    """Backward of one mini-batch's loss, micro-batch by micro-batch; returns this rank's named sums.

    Each micro-batch's loss is its share of the mini-batch loss, normalised by GLOBAL token and sequence
    counts, and FSDP sums (not averages) gradients over ranks: any rank/micro-batch split gives one gradient.
    """
    cfg, b = run.cfg, batch
    global_tokens = float(distributed.all_reduce([float(b.mask[mini].sum())])[0])
    norm = dict(global_tokens=global_tokens, global_sequences=(mini.stop - mini.start) * run.env.world_size)
    zero = torch.zeros((), dtype=torch.float64, device=run.env.device)
    sums = dict.fromkeys(("loss", "clip_fraction", "approx_kl", "kl_ref"), zero)  # device values: no host read here
    for rows in (r for r in run.micro if mini.start <= r.start < mini.stop):
        log_probs, _ = run.policy(b.sequences[rows], b.attention[rows], b.positions[rows], targets=b.response_ids[rows])
        loss, stats = clipped_policy_loss(
            log_probs,
            b.old_log_probs[rows],
            b.advantages[rows],
            b.mask[rows],
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            aggregation=cfg.loss_agg,
            **norm,
        )
        if run.reference is not None:
            kl = kl_penalty(log_probs, b.ref_log_probs[rows], cfg.kl_estimator)
            loss = loss + cfg.kl_coef * aggregate(kl, b.mask[rows], cfg.loss_agg, **norm)
            sums["kl_ref"] = sums["kl_ref"] + aggregate(kl.detach(), b.mask[rows], "token-mean", **norm)
        loss.backward()
        sums["loss"] = sums["loss"] + loss.detach()
        sums["clip_fraction"] = sums["clip_fraction"] + stats["clipped_tokens"] / global_tokens
        sums["approx_kl"] = sums["approx_kl"] + stats["approx_kl_sum"] / global_tokens
    values = torch.stack([value.double() for value in sums.values()]).tolist()  # one host read per mini-batch
    return dict(zip(sums, values))


def update(run: Run, batch: Batch, step: int, state: dict) -> dict[str, float]:
    """--epochs passes of --mini-batches optimizer steps; returns the named means over those updates.

    A non-finite loss or gradient norm skips the optimizer step on every rank (all see the same global values).
    """
    cfg, optimizer = run.cfg, run.optimizer
    rows_per_mini, updates = len(run.global_rows) // cfg.mini_batches, cfg.mini_batches * cfg.epochs
    totals = dict.fromkeys(("loss", "grad_norm", "clip_fraction", "approx_kl", "kl_ref"), 0.0)
    skipped, lr = 0, cfg.lr
    # The optimizer's parameters: FSDP2's sharded DTensors (the module's own may be unsharded between passes).
    trained = [p for group in optimizer.param_groups for p in group["params"]]
    before = [_local(p).detach().clone() for p in trained]
    for _ in range(cfg.epochs):
        for k in range(cfg.mini_batches):
            lr = learning_rate(cfg, state["updates"], state["tokens"], run.schedule_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            sums = distributed.all_reduce_named(
                accumulate_gradients(run, batch, slice(k * rows_per_mini, (k + 1) * rows_per_mini))
            )
            max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
            grad_norm = torch.nn.utils.clip_grad_norm_(run.policy.parameters(), max_norm)
            grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)  # global
            if math.isfinite(grad_norm) and math.isfinite(sums["loss"]):
                optimizer.step()
            else:
                skipped += 1
                if run.env.is_main:
                    run.progress.write(
                        f"step {step}: non-finite loss ({sums['loss']}) or gradient norm ({grad_norm}); update skipped",
                        file=sys.stderr,
                    )
            optimizer.zero_grad(set_to_none=True)
            state["updates"] += 1
            for key, value in (*sums.items(), ("grad_norm", grad_norm)):
                totals[key] += value
    squares = [(_local(p).detach() - p0).double().square().sum() for p, p0 in zip(trained, before)]
    change = float(torch.stack(squares).sum()) if squares else 0.0  # one host read
    update_norm = distributed.all_reduce_named({"change": change})["change"] ** 0.5  # ||θ_after − θ_before||, global
    return {**{key: value / updates for key, value in totals.items()}, "skipped": skipped, "lr": lr,
            "update_norm": update_norm}  # fmt: skip


def _local(parameter: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (possibly FSDP2-sharded) parameter."""
    return parameter.to_local() if hasattr(parameter, "to_local") else parameter


def step_metrics(run: Run, batch: Batch, stats: dict[str, float], step: int, state: dict) -> dict:
    """The step's metrics over all ranks, as a named record (one line of metrics.jsonl); ``state`` is the
    trainer state before this step (its token and skip counters are carried forward)."""
    cfg, env, b, n = run.cfg, run.env, batch, run.cfg.group_size
    lengths, count = b.mask.sum(dim=1), cfg.prompts_per_step * n
    group_scores = b.scores.view(-1, n)  # rows are prompt-major: N consecutive rows per prompt
    local = {
        "reward": float(b.scores.sum()),
        "reward_sq": float(b.scores.square().sum()),
        "tokens": float(lengths.sum()),
        "sequence_tokens": float(b.attention.sum()),  # prompt + response tokens, no padding
        "truncated": float((~b.finished).sum()),
        "zero_variance_groups": float((group_scores.amax(dim=1) == group_scores.amin(dim=1)).sum()),
        "neg_log_prob": float(torch.where(b.mask, -b.old_log_probs, 0.0).sum()),  # sampled-token entropy estimate
        "neg_log_sum_pi_squared": float(torch.where(b.mask, -b.sum_pi_squared.log(), 0.0).sum()),  # Renyi-2 entropy
        **{key: b.proxy[f"variance_proxy/{key}"] for key in ("proxy2_total_power", "expected_a_squared", "expected_w")},
    }
    total = distributed.all_reduce_named(local)
    generated, reward_mean = total["tokens"], total["reward"] / count
    power, grad_norm = total["proxy2_total_power"] / env.world_size, stats["grad_norm"]  # ranks: equal row counts
    return {
        "step": step,
        "tokens": state["tokens"] + int(generated),
        "generated_tokens": int(generated),
        "sequence_tokens": int(total["sequence_tokens"]),
        "reward_mean": reward_mean,
        "reward_std": math.sqrt(max(0.0, total["reward_sq"] / count - reward_mean**2)),
        "response_length_mean": generated / count,
        "response_length_max": int(distributed.all_reduce([float(lengths.max())], op="max")[0]),
        "truncated_fraction": total["truncated"] / count,
        "zero_variance_group_fraction": total["zero_variance_groups"] / cfg.prompts_per_step,
        "entropy": total["neg_log_prob"] / generated,
        "entropy_renyi2": total["neg_log_sum_pi_squared"] / generated,
        "loss": stats["loss"],
        "grad_norm": grad_norm,
        "update_norm": stats["update_norm"],
        "lr": stats["lr"],
        "clip_fraction": stats["clip_fraction"],
        "approx_kl": stats["approx_kl"],
        "skipped": stats["skipped"],
        "skipped_total": state["skipped_total"] + stats["skipped"],
        # THEORY §5 over the global batch: signal = ||g||², total power P, noise = (P - signal) / (B - 1).
        "variance_proxy/proxy1_signal_strength": grad_norm**2,
        "variance_proxy/proxy2_total_power": power,
        "variance_proxy/proxy3_pure_noise": max(0.0, (power - grad_norm**2) / (count - 1)) if count > 1 else 0.0,
        "variance_proxy/expected_a_squared": total["expected_a_squared"] / env.world_size,
        "variance_proxy/expected_w": total["expected_w"] / env.world_size,
        **({"kl_ref": stats["kl_ref"]} if run.reference is not None else {}),
    }


def add_timings(record: dict, times: dict[str, float], epochs: int, parameters: int) -> None:
    """Wall-clock seconds per phase and throughputs (the only non-deterministic fields of a record).

    ``throughput/update_model_tflops``: the update's model FLOPs per second, 6 x parameters x non-pad prompt and
    response tokens x epochs / its time (1e12 FLOP/s units); over a device's peak, the update's MFU.
    """
    phases = list(times)
    for before, after in zip(phases, phases[1:]):
        record[f"time/{after}"] = times[after] - times[before]
    record["time/step"] = times[phases[-1]] - times[phases[0]]
    record["throughput/generation_tokens_per_s"] = record["generated_tokens"] / record["time/rollout"]
    record["throughput/update_tokens_per_s"] = record["generated_tokens"] * epochs / record["time/update"]
    flops = 6 * parameters * record["sequence_tokens"] * epochs
    record["throughput/update_model_tflops"] = flops / record["time/update"] / 1e12


def write_samples(run: Run, batch: Batch, step: int) -> None:
    """The first response to each of this rank's first --num-samples prompts, into samples.jsonl."""
    n = run.cfg.group_size
    for p, problem in enumerate(batch.problems[: run.cfg.num_samples]):
        row = p * n
        run.samples_log.write(
            {
                "step": step,
                "prompt": problem.prompt,
                "answer": problem.answer,
                "response": batch.texts[row],
                "reward": float(batch.scores[row]),
                "finished": bool(batch.finished[row]),
                "length": int(batch.mask[row].sum()),
            }
        )


def report(run: Run, record: dict) -> None:
    """Progress bar, and a warning (at most every 20 steps) when most responses hit --max-new-tokens."""
    step = record["step"]
    if record["truncated_fraction"] > 0.5 and step - run.last_truncation_warning >= 20 and run.env.is_main:
        run.last_truncation_warning = step
        run.progress.write(
            f"step {step}: {record['truncated_fraction']:.0%} of responses hit --max-new-tokens "
            f"{run.cfg.max_new_tokens} without EOS; raise it if answers are being cut",
            file=sys.stderr,
        )
    run.progress.set_postfix(
        reward=f"{record['reward_mean']:.2f}", len=f"{record['response_length_mean']:.1f}", refresh=False
    )
    run.progress.update(record["generated_tokens"] if run.cfg.token_budget else 1)


# ----------------------------------------------------------------------------- setup


def prepare(cfg: Config, data, line_numbers: list[int], env: distributed.Dist) -> tuple[Run, dict | None]:
    """Every check that can fail, then the models, optimizer and row layout; writes nothing.
    Returns the run and the first start's configuration (None for a new run)."""
    if cfg.prompts_per_step % (env.world_size * cfg.mini_batches):
        raise UserError(
            f"--prompts-per-step ({cfg.prompts_per_step}) must be divisible by the number of ranks "
            f"({env.world_size}) times --mini-batches ({cfg.mini_batches})"
        )
    cfg.output_dir = cfg.output_dir or distributed.broadcast_object(time.strftime("runs/%Y%m%d-%H%M%S"))
    first = check_run_directory(cfg, Path(cfg.output_dir))
    distributed.barrier()  # every rank has looked before rank 0 writes anything there
    lm, tokenizer, eos_ids, pad_id = build_model_and_tokenizer(cfg)
    if data is not None:
        check_prompts(cfg, data, line_numbers, tokenizer)
    cfg.static_decode = use_static_decode(cfg, lm, env)  # resolved: config.json records the decoder that ran
    lm.eval()  # no dropout in RL: generation, old log-probs and the loss see the same function
    bf16 = cfg.mixed_precision == "bf16" or (cfg.mixed_precision == "auto" and env.device.type == "cuda")
    # "otb_exact" needs ||S_t||^2 at every token: otb_ref.exact on a full copy (small models only). "eob" needs
    # ||S||^2 per response: one forward + backward of the sharded policy itself (otb_ref.row_grad_norms_sq).
    exact_lm = copy.deepcopy(lm).to(env.device) if "cumulative_energy" in ESTIMATORS[cfg.estimator].inputs else None
    ref_lm = copy.deepcopy(lm).requires_grad_(False) if cfg.kl_coef > 0 else None  # frozen initial policy
    policy = shard_policy(cfg, lm, env, bf16, cfg.activation_checkpointing, cfg.compile_layers)
    reference = shard_policy(cfg, ref_lm, env, bf16, False, False) if ref_lm is not None else None
    # fused: one kernel for the whole AdamW update on CUDA (no per-tensor launches; the same update rule)
    fused = env.device.type == "cuda"
    optimizer = torch.optim.AdamW(
        policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999), fused=fused
    )
    positions, n = local_prompt_positions(cfg, env), cfg.group_size
    rows_per_mini = len(positions) * n // cfg.mini_batches
    micro = [
        slice(start, min(start + cfg.micro_batch_size, (k + 1) * rows_per_mini))
        for k in range(cfg.mini_batches)
        for start in range(k * rows_per_mini, (k + 1) * rows_per_mini, cfg.micro_batch_size)
    ]
    run = Run(
        cfg=cfg,
        env=env,
        output_dir=Path(cfg.output_dir),
        data=data,
        tokenizer=tokenizer,
        eos_ids=eos_ids,
        pad_id=pad_id,
        policy=policy,
        reference=reference,
        exact_lm=exact_lm,
        optimizer=optimizer,
        schedule_steps=first["steps"] if first else cfg.steps,
        prompt_positions=positions,
        global_rows=torch.tensor([p * n + i for p in positions for i in range(n)]),
        micro=micro,
        parameters=sum(p.numel() for p in policy.parameters()),  # a DTensor's numel is the full tensor's
    )
    return run, first


def use_static_decode(cfg: Config, lm: nn.Module, env: distributed.Dist) -> bool:
    """--static-decode: on when asked (refused for a model it cannot run); by default on CUDA whenever the model is
    supported (the same float64 sampler either way), else the model's own forward, saying why on CUDA."""
    why = static_decode_unsupported(lm)
    if cfg.static_decode and why:
        raise UserError(f"--static-decode: {why}")
    static = cfg.static_decode if cfg.static_decode is not None else env.device.type == "cuda" and why is None
    if cfg.drop_finished_rows and not static:
        hint = "add --static-decode"
        if why:
            hint = f"static decode: {why}"
        elif cfg.static_decode is False:
            hint = "not with --no-static-decode"
        raise UserError(f"--drop-finished-rows: only the static decoder drops rows ({hint})")
    if cfg.static_decode is None and env.device.type == "cuda" and why and env.is_main:
        print(f"train.py: generating with the model's own forward (static decode: {why})", file=sys.stderr)
    return static


def restore(run: Run) -> tuple[dict, Path | None]:
    """The trainer state: fresh, or loaded (with the model and optimizer) from the newest complete checkpoint."""
    state = {"step": 0, "tokens": 0, "skipped_total": 0, "data_position": 0, "updates": 0}
    latest = checkpoints.latest_checkpoint(run.output_dir) if run.cfg.resume else None
    if latest is not None:
        state = checkpoints.load_checkpoint(latest, run.policy, run.optimizer, state, run.env)
    return state, latest


def finished(cfg: Config, state: dict) -> bool:
    return state["step"] >= cfg.steps or bool(cfg.token_budget and state["tokens"] >= cfg.token_budget)


def start_logs(run: Run, first: dict | None, state: dict, latest: Path | None) -> None:
    """config.json (written once, at the first start), config_history.jsonl (every start), the logs; says what runs."""
    cfg, env, out = run.cfg, run.env, run.output_dir
    if env.is_main:
        record_configuration(out, first, config_record(cfg), state["step"])
        how = f"resumed from {latest.name}" if latest else "from scratch"
        how += " (no complete checkpoint found)" if cfg.resume and not latest else ""
        print(f"run {out}: {env.world_size} rank(s) on {env.device}, estimator {cfg.estimator}, {how}", file=sys.stderr)
        print(describe(cfg), file=sys.stderr)
        if first and cfg.steps > run.schedule_steps and not cfg.token_budget:
            print(
                f"--steps {cfg.steps} extends the run past its first --steps {run.schedule_steps}: the learning-rate "
                f"schedule keeps that horizon, so steps {run.schedule_steps + 1}-{cfg.steps} run at "
                f"--min-lr-ratio x --lr = {cfg.min_lr_ratio * cfg.lr:.3g}",
                file=sys.stderr,
            )
    resume_step = state["step"] if cfg.resume else None
    run.metrics_log = JsonlLog(out, env, resume_step=resume_step, tensorboard=cfg.tensorboard)
    run.samples_log = JsonlLog(out, env, resume_step=resume_step, name="samples.jsonl")


def sync(env: distributed.Dist) -> float:
    if env.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


# ----------------------------------------------------------------------------- the loop


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(sys.argv[1:] if argv is None else argv)
    if problem := distributed.device_problem(cfg.device):
        raise UserError(problem)
    data, line_numbers = load_jsonl(cfg.data) if cfg.data else (None, [])
    env = distributed.init(cfg.device)
    try:
        train(cfg, data, line_numbers, env)
    except BaseException:
        distributed.shutdown()
        raise
    distributed.shutdown(wait_for_peers=True)


def train(cfg: Config, data: list[Problem] | None, line_numbers: list[int], env: distributed.Dist) -> None:
    """rollout -> score -> old log-probs -> advantages -> update -> log and checkpoint, step after step."""
    from tqdm import tqdm

    run, first = prepare(cfg, data, line_numbers, env)
    state, latest = restore(run)
    if finished(cfg, state):
        if env.is_main:
            print(
                f"train.py: {run.output_dir} is complete (step {state['step']}, {state['tokens']} tokens): nothing "
                "to do; pass a larger --steps to extend it",
                file=sys.stderr,
            )
        return
    start_logs(run, first, state, latest)
    budget = bool(cfg.token_budget)
    run.progress = tqdm(
        total=cfg.token_budget or cfg.steps,
        initial=state["tokens" if budget else "step"],
        unit="tok" if budget else "it",
        disable=not env.is_main,
        desc="train",
        dynamic_ncols=True,
    )
    first_step, rewards, started = state["step"] + 1, [], time.perf_counter()
    for step in range(first_step, cfg.steps + 1):
        times = {"start": sync(env)}
        if env.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        batch = rollout(run, step, state["data_position"])
        score(run, batch)
        times["rollout"] = sync(env)
        old_log_probs(run, batch)
        times["logprobs"] = sync(env)
        estimate_advantages(run, batch)
        times["advantages"] = sync(env)
        stats = update(run, batch, step, state)
        times["update"] = sync(env)

        record = step_metrics(run, batch, stats, step, state)
        add_timings(record, times, cfg.epochs, run.parameters)
        if env.device.type == "cuda":  # this rank's largest allocation during the step, GiB
            record["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        state.update(
            step=step,
            tokens=record["tokens"],
            skipped_total=record["skipped_total"],
            data_position=state["data_position"] + cfg.prompts_per_step,
        )
        stop = finished(cfg, state)
        run.metrics_log.write(record)
        if cfg.sample_every and (step == first_step or step % cfg.sample_every == 0 or stop):
            write_samples(run, batch, step)
        report(run, record)
        rewards.append(record["reward_mean"])
        if stop or (cfg.save_every and step % cfg.save_every == 0):
            checkpoints.save_checkpoint(
                run.output_dir, step, run.policy, run.optimizer, state, env, cfg.keep_checkpoints
            )
        if stop:
            break
    run.progress.close()
    if env.is_main:
        print(summary(run, state, first_step, rewards, time.perf_counter() - started), file=sys.stderr)


def summary(run: Run, state: dict, first_step: int, rewards: list[float], seconds: float) -> str:
    """One line at the end of a run: steps, time, tokens, reward at the start and the end, where the outputs are."""
    k = min(10, len(rewards))
    start, end = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    return (
        f"train.py: done: steps {first_step}-{state['step']} in {seconds:.0f} s, {state['tokens']} generated tokens "
        f"in all; mean reward {start:.3f} over the first {k} steps, {end:.3f} over the last {k}; "
        f"{state['skipped_total']} updates skipped; outputs in {run.output_dir}"
    )


if __name__ == "__main__":
    try:
        main()
    except UserError as error:
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank finds the same mistake: rank 0 reports it
            print(f"train.py: error: {error}", file=sys.stderr)
        sys.exit(2)
