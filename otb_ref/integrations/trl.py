"""TRL's ``GRPOTrainer`` with token-level advantages from any otb_ref estimator (tested: TRL 1.16).

    from otb_ref.integrations.trl import OTBGRPOTrainer

    trainer = OTBGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=..., estimator="otb")
    trainer.train()

TRL computes one advantage per completion; this subclass replaces them, through two of TRL's hooks
(``_calculate_rewards`` to keep the rewards, ``_generate_and_score_completions`` to replace ``"advantages"``), by
``[B, T]`` advantages of :func:`otb_ref.compute_advantages`: the reward of each completion stands at its last
trained token (``completion_mask × tool_mask``), groups are TRL's (``num_generations`` consecutive completions of
one prompt, across processes: the rows of every process are gathered, the estimator runs on the whole generation
batch, and each process keeps its own rows). TRL's loss takes ``[B, T]`` advantages as they are.

Proxy energies (``otb``, ``sequence_proxy``) need old log-probs and Σπ² at the sampling temperature. They come from
TRL's own fused LM head (``log_sum_sq_probs`` = log Σπ², same kernel, same log-probs): where TRL runs its no-grad
old-log-prob pass (``num_iterations > 1``, misaligned gradient accumulation, vLLM importance sampling), Σπ² is read
from that pass; otherwise one no-grad pass is added (its time is logged as ``otb/extra_pass_seconds``).

Refused at construction, with one error listing every reason: estimators that need gradient norms (``eob``,
``otb_exact``); per-sequence options (``loss_type`` "vespo" or "luspo", ``importance_sampling_level="sequence"``,
``off_policy_mask_threshold``, ``scale_rewards="batch"``, ``multi_objective_aggregation="normalize_then_sum"``);
vision-language models with proxy energies (the added pass forwards no images); TRL versions outside
:data:`TESTED_TRL`.
"""

from __future__ import annotations

import functools
import math
import time

import torch
import trl
from accelerate.utils import is_peft_model
from trl import GRPOTrainer
from trl.trainer.utils import add_fused_lm_head

from otb_ref.advantages import compute_advantages
from otb_ref.estimators import resolve_estimator

__all__ = ["OTBGRPOTrainer", "TESTED_TRL"]

TESTED_TRL = ((1, 16),)  # (major, minor) releases whose hooks this subclass was tested against


def _version_problem(version: str) -> str | None:
    parts = version.split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        major_minor = None
    if major_minor in TESTED_TRL:
        return None
    tested = ", ".join(f"{major}.{minor}.x" for major, minor in TESTED_TRL)
    return f"trl {version} is untested (tested: {tested}); OTBGRPOTrainer relies on GRPOTrainer's internal hooks"


class OTBGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose advantages are otb_ref's token-level (or sequence-level) estimators.

    Args (besides ``GRPOTrainer``'s):
        estimator: a name of :data:`otb_ref.ESTIMATORS` or an :class:`otb_ref.Estimator` that needs no gradient
            norms; default ``"otb"``.
        leave_one_out: baselines from the other completions of the prompt; default: the estimator's.
        std_normalize: divide by the group's spread (THEORY §3); default: the estimator's, and off when
            ``GRPOConfig.scale_rewards="none"``.
        multi_turn: align completions by generated-token rank (tool output is a hole); default: on when TRL hands
            a ``tool_mask``.
        handle_zero_tail: zero the unique longest completion's baseline past the second-longest length (§4).
        epsilon: ε of the std and of energy-weighted denominators; default TRL's std ε 1e-4 with std scaling,
            else otb_ref's 1e-8.
    """

    def __init__(
        self,
        *args,
        estimator="otb",
        leave_one_out=None,
        std_normalize=None,
        multi_turn=None,
        handle_zero_tail=False,
        epsilon=None,
        **kwargs,
    ):
        problem = _version_problem(trl.__version__)
        if problem:
            raise ValueError(problem)
        spec = resolve_estimator(estimator, leave_one_out, std_normalize)  # ValueError naming `estimator`
        super().__init__(*args, **kwargs)
        if std_normalize is None and self.args.scale_rewards == "none":
            spec = resolve_estimator(spec, std_normalize=False)
        problems = self._problems(spec)
        if problems:
            raise ValueError("OTBGRPOTrainer cannot honour this set-up: " + "; ".join(problems))
        self.otb_estimator = spec
        self.otb_multi_turn = multi_turn
        self.otb_handle_zero_tail = handle_zero_tail
        self.otb_epsilon = (1e-4 if spec.std_normalize else 1e-8) if epsilon is None else epsilon
        self._otb_rewards_per_func = None
        self._otb_capture = None  # list of captured log Σπ² chunks while a no-grad fused pass runs, else None
        if spec.energy == "proxy":
            self._add_sum_pi_squared_output()

    def _problems(self, spec) -> list[str]:
        args, problems = self.args, []
        if spec.energy == "exact":
            problems.append("estimator: energy 'exact' needs per-response gradient norms, which TRL does not compute")
        if args.loss_type in ("vespo", "luspo"):
            problems.append(f"loss_type={args.loss_type!r} assumes one advantage per sequence")
        if args.importance_sampling_level == "sequence":
            problems.append("importance_sampling_level='sequence' assumes one advantage per sequence")
        if args.off_policy_mask_threshold is not None:
            problems.append("off_policy_mask_threshold masks sequences by a per-sequence advantage sign")
        if args.scale_rewards == "batch":
            problems.append("scale_rewards='batch' is a per-sequence batch std; use std_normalize= instead")
        if args.multi_objective_aggregation != "sum_then_normalize":
            problems.append(f"multi_objective_aggregation={args.multi_objective_aggregation!r} normalises per sequence")
        if spec.energy == "proxy" and getattr(self, "_is_vlm", False):
            problems.append("vision-language models: the Σπ² pass forwards no images")
        return problems

    # ------------------------------------------------------------------ Σπ² from TRL's fused LM head

    def _add_sum_pi_squared_output(self) -> None:
        """A second fused head with the ``log_sum_sq_probs`` output, used only by no-grad passes while capturing;
        every other call (generation, the loss) goes to TRL's head unchanged."""
        model = self.model.get_base_model() if is_peft_model(self.model) else self.model
        trl_forward = model.forward
        add_fused_lm_head(
            model,
            temperature=self.temperature,
            cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32,
            outputs=("log_probs", "entropy", "log_sum_sq_probs"),
        )
        with_sum_sq = model.forward
        trainer = self

        @functools.wraps(trl_forward)
        def forward(*args, **kwargs):
            if trainer._otb_capture is None or not kwargs.get("fused_lm_head") or torch.is_grad_enabled():
                return trl_forward(*args, **kwargs)
            outputs = with_sum_sq(*args, **kwargs)
            trainer._otb_capture.append(outputs.log_sum_sq_probs)
            return outputs

        model.forward = forward

    def _old_log_probs_and_sum_pi_squared(self, output: dict, captured: list) -> tuple[torch.Tensor, torch.Tensor]:
        """From TRL's own old-log-prob pass (its first ``ceil(B / batch)`` captured chunks), else one added pass."""
        completion_ids = output["completion_ids"]
        rows, keep = completion_ids.shape
        batch_size = (
            self.args.per_device_train_batch_size if self.model.training else self.args.per_device_eval_batch_size
        )
        chunks = math.ceil(rows / batch_size)
        if "old_per_token_logps" in output and len(captured) >= chunks:
            log_sum_sq = torch.cat(captured[:chunks])[:, -keep:]
            return output["old_per_token_logps"], log_sum_sq.exp()
        start = time.perf_counter()
        self._otb_capture = captured = []
        try:
            with torch.no_grad():
                log_probs, _, _ = self._get_per_token_logps_and_entropies(
                    self.model,
                    torch.cat([output["prompt_ids"], completion_ids], dim=1),
                    torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1),
                    keep,
                    batch_size=batch_size,
                )
        finally:
            self._otb_capture = None
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["otb/extra_pass_seconds"].append(time.perf_counter() - start)
        return log_probs, torch.cat(captured)[:, -keep:].exp()

    # ------------------------------------------------------------------ TRL's hooks

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        self._otb_rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self._otb_rewards_per_func

    def _generate_and_score_completions(self, inputs):
        captured = []
        self._otb_capture = captured if self.otb_estimator.energy == "proxy" else None
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._otb_capture = None
        output["advantages"] = self._token_advantages(output, captured)
        return output

    # ------------------------------------------------------------------ the advantages

    def _token_advantages(self, output: dict, captured: list) -> torch.Tensor:
        """``[B_local, T]`` advantages of the whole generation batch (all processes), this process's rows."""
        mask = output["completion_mask"].float()
        if "tool_mask" in output:
            mask = mask * output["tool_mask"].float()
        local_rows, length = mask.shape
        energies = {}
        if self.otb_estimator.energy == "proxy":
            old_log_probs, sum_pi_squared = self._old_log_probs_and_sum_pi_squared(output, captured)
            energies = dict(old_log_probs=self._gather_rows(old_log_probs.float(), 0.0),
                            sum_pi_squared=self._gather_rows(sum_pi_squared.float(), 1.0))  # fmt: skip
        mask_all = self._gather_rows(mask, 0.0)  # [B, T_max]
        rewards_per_func = self._otb_rewards_per_func
        rewards = (rewards_per_func * self.reward_weights.to(rewards_per_func.device)).nansum(dim=1)  # TRL's sum
        group = torch.arange(len(rewards), device=mask.device) // (
            self.num_generations if self.model.training else self.num_generations_eval
        )
        unscorable = torch.isnan(rewards_per_func).all(dim=1)  # TRL: no baseline share, advantage 0
        group = torch.where(unscorable, group.max() + 1 + torch.arange(len(group), device=group.device), group)
        mask_all = mask_all * (~unscorable)[:, None]
        multi_turn = ("tool_mask" in output) if self.otb_multi_turn is None else self.otb_multi_turn
        advantages, _ = compute_advantages(
            self.otb_estimator,
            _outcome_at_last_token(torch.nan_to_num(rewards).float(), mask_all),
            mask_all,
            group,
            **energies,
            multi_turn=multi_turn and self.otb_estimator.granularity == "token",
            handle_zero_tail=self.otb_handle_zero_tail and self.otb_estimator.granularity == "token",
            epsilon=self.otb_epsilon,
        )
        start = self.accelerator.process_index * local_rows
        return advantages[start : start + local_rows, :length]

    def _gather_rows(self, tensor: torch.Tensor, fill: float) -> torch.Tensor:
        """``[B_local, T]`` → ``[B, T_max]``: every process's rows in process order, padded on the right."""
        if self.accelerator.num_processes == 1:
            return tensor
        padded = self.accelerator.pad_across_processes(tensor, dim=1, pad_index=fill)
        return self.accelerator.gather(padded)


def _outcome_at_last_token(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` token rewards: each row's reward at its last position with ``mask = 1`` (none for empty rows)."""
    if mask.shape[1] == 0:
        return torch.zeros_like(mask)
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask > 0, positions, -1).amax(dim=1, keepdim=True)  # -1 for an empty row
    return torch.where(positions == last, rewards[:, None], 0.0)
