"""The names verl and TRL give this project's config keys, for "did you mean" suggestions (g2rl_jax.config).

A key a user brings from another trainer (`optim.lr`, `rollout.n`, `beta`,
`actor_rollout_ref.actor.ppo_mini_batch_size`, ...) is matched by its longest dotted suffix in ALIASES; the
suggestion names this project's key and, where the meaning differs, how to convert the value.
"""
from __future__ import annotations

# {foreign name (a dotted suffix): (this project's key, who uses the name, note)}; verl's names as in its
# ppo_trainer.yaml, TRL's as in its GRPOConfig.
ALIASES: dict[str, tuple[str, str, str]] = {
    # optimizer
    "lr": ("optim.learning_rate", "verl", ""),
    "lr_warmup_steps": ("optim.warmup_steps", "verl", ""),
    "warmup_ratio": ("optim.warmup_steps", "TRL", "a number of optimizer updates here, not a fraction"),
    "lr_warmup_steps_ratio": ("optim.warmup_steps", "verl", "a number of optimizer updates here, not a fraction"),
    "grad_clip": ("optim.max_grad_norm", "verl", ""),
    "adam_beta1": ("optim.b1", "TRL", ""),
    "adam_beta2": ("optim.b2", "TRL", ""),
    "adam_epsilon": ("optim.eps", "TRL", ""),
    "min_lr_ratio": ("optim.min_lr_ratio", "verl", ""),
    # batch sizes and epochs
    "train_batch_size": ("data.prompts_per_step", "verl", ""),
    "ppo_mini_batch_size": ("algorithm.mini_batch_size", "verl", "counted in responses here: verl's value x rollout.n"),
    "ppo_micro_batch_size": ("algorithm.micro_batch_size", "verl", "responses per forward/backward over all devices"),
    "ppo_micro_batch_size_per_gpu": ("algorithm.micro_batch_size", "verl", "over all devices here: x the device count"),
    "log_prob_micro_batch_size_per_gpu": ("algorithm.micro_batch_size", "verl",
                                          "over all devices here: x the device count"),
    "per_device_train_batch_size": ("algorithm.micro_batch_size", "TRL", "over all devices here: x the device count"),
    "gradient_accumulation_steps": ("algorithm.micro_batch_size", "TRL",
                                    "accumulation steps are algorithm.mini_batch_size / algorithm.micro_batch_size"),
    "num_iterations": ("algorithm.ppo_epochs", "TRL", ""),
    "ppo_epochs": ("algorithm.ppo_epochs", "verl", ""),
    "total_training_steps": ("run.total_steps", "verl", ""),
    "max_steps": ("run.total_steps", "TRL", ""),
    "total_epochs": ("run.total_steps", "verl", "RL steps, not epochs"),
    "num_train_epochs": ("run.total_steps", "TRL", "RL steps, not epochs"),
    # rollout
    "rollout.n": ("rollout.num_samples", "verl", ""),
    "num_generations": ("rollout.num_samples", "TRL", ""),
    "response_length": ("rollout.max_new_tokens", "verl", ""),
    "max_response_length": ("rollout.max_new_tokens", "verl", ""),
    "max_completion_length": ("rollout.max_new_tokens", "TRL", ""),
    "max_prompt_length": ("data.max_prompt_tokens", "verl and TRL", ""),
    # loss
    "kl_coef": ("algorithm.kl_coef", "verl", ""),
    "kl_loss_coef": ("algorithm.kl_coef", "verl", ""),
    "use_kl_loss": ("algorithm.kl_coef", "verl", "0 turns the KL loss off"),
    "beta": ("algorithm.kl_coef", "TRL", ""),
    "kl_loss_type": ("algorithm.kl_kind", "verl", "low_var_kl is k3 here"),
    "kl_penalty": ("algorithm.kl_kind", "verl", "low_var_kl is k3 here"),
    "entropy_coeff": ("algorithm.entropy_coef", "verl", ""),
    "clip_ratio": ("algorithm.clip_low", "verl", "and algorithm.clip_high"),
    "clip_ratio_low": ("algorithm.clip_low", "verl", ""),
    "clip_ratio_high": ("algorithm.clip_high", "verl", ""),
    "epsilon": ("algorithm.clip_low", "TRL", ""),
    "epsilon_high": ("algorithm.clip_high", "TRL", ""),
    "clip_ratio_c": ("algorithm.dual_clip", "verl", ""),
    "loss_agg_mode": ("algorithm.loss_agg", "verl", ""),
    "loss_type": ("algorithm.loss_agg", "TRL", "token-mean, seq-mean-token-mean or seq-mean-token-sum"),
    "importance_sampling_level": ("algorithm.ratio_level", "TRL", ""),
    "adv_estimator": ("algorithm.exploration", "verl", "GRPO advantages always; this picks the exploration signal"),
    "filter_groups.enable": ("algorithm.dynamic_sampling", "verl", ""),
    "max_num_gen_batches": ("algorithm.max_sampling_rounds", "verl", ""),
    # reward
    "reward_funcs": ("reward.function", "TRL", ""),
    "custom_reward_function.path": ("reward.function", "verl", "'file.py:fn'"),
    "overlong_buffer.len": ("reward.overlong_buffer", "verl", ""),
    "overlong_buffer.penalty_factor": ("reward.overlong_penalty", "verl", ""),
    "mask_truncated_completions": ("reward.truncated", "TRL", "mask"),
    # model, data, run
    "model_name_or_path": ("model.path", "TRL", "a local Hugging Face directory"),
    "gradient_checkpointing": ("model.remat", "TRL", ""),
    "enable_gradient_checkpointing": ("model.remat", "verl", ""),
    "bf16": ("model.compute_dtype", "TRL", ""),
    "train_files": ("data.train_dataset", "verl", ""),
    "val_files": ("data.eval_datasets", "verl", ""),
    "dataset_name": ("data.train_dataset", "TRL", "a registered name or a local .jsonl file"),
    "save_freq": ("run.checkpoint_every", "verl", ""),
    "save_steps": ("run.checkpoint_every", "TRL", ""),
    "test_freq": ("run.eval_every", "verl", ""),
    "eval_steps": ("run.eval_every", "TRL", ""),
    "default_local_dir": ("run.output_dir", "verl", ""),
    "logger": ("run.loggers", "verl", ""),
    "report_to": ("run.loggers", "TRL", ""),
    "nnodes": ("distributed.num_processes", "verl", ""),
}


def alias(key: str) -> tuple[str, str, str, str] | None:
    """(the foreign name matched, this project's key, who uses the name, note) for the longest dotted suffix of
    `key` in ALIASES."""
    parts = key.split(".")
    for start in range(len(parts)):
        suffix = ".".join(parts[start:])
        if suffix in ALIASES:
            return (suffix, *ALIASES[suffix])
    return None


def suggestion(key: str) -> str | None:
    """"did you mean 'optim.learning_rate'? (verl's lr)", with the note where the meaning differs; or None."""
    found = alias(key)
    if found is None:
        return None
    name, ours, who, note = found
    return f"did you mean '{ours}'? ({who}'s {name}{'; ' + note if note else ''})"
