// What each plotted metric is called on the dashboard: a human title and its unit; the raw metric name
// (the train_step event's key, TensorBoard's tag) goes into the title's tooltip.
"use strict";

const METRIC_LABELS = {
  reward_mean: ["Trained batch reward (mean)", "reward"],
  pg_loss: ["Policy-gradient loss", "loss"],
  loss: ["Total loss", "loss"],
  kl: ["KL divergence to the start weights", "nats / token"],
  kl_loss: ["KL penalty term of the loss", "loss"],
  entropy: ["Policy entropy", "nats / token"],
  entropy_loss: ["Entropy bonus term of the loss", "loss"],
  clip_frac: ["Tokens with a clipped ratio", "fraction"],
  dual_clip_frac: ["Tokens clipped by the dual clip", "fraction"],
  grad_norm: ["Gradient norm (before clipping), largest of the step", "L2 norm"],
  grad_norm_mean: ["Gradient norm (before clipping), mean over the step", "L2 norm"],
  ratio_mean: ["Policy ratio new / old, mean", "ratio"],
  ratio_max: ["Policy ratio new / old, maximum", "ratio"],
  lr: ["Learning rate", "per step"],
  tokens_per_s: ["Trainer throughput", "tokens / s"],
  batch_weight_version: ["Weight version that generated the batch", "version"],
  stale_frac: ["Batch rows older than the trainer's weights", "fraction"],
  tis_weight_mean: ["TIS weight, mean", "ratio"],
  tis_clipped_frac: ["TIS weights at the cap", "fraction"],
  tis_ratio_mean: ["TIS ratio trainer / rollout, mean", "ratio"],
  tis_ratio_min: ["TIS ratio trainer / rollout, minimum", "ratio"],
  tis_ratio_max: ["TIS ratio trainer / rollout, maximum", "ratio"],
  tis_clip_frac: ["TIS ratios above the cap", "fraction"],
  zero_variance_groups: ["Groups without reward variance", "fraction"],
  malformed_rate: ["Malformed samples in the batch", "fraction"],
  value_loss: ["Value head loss", "loss"],
  value_fit_loss: ["Value fit loss", "loss"],
  value_mean: ["Value estimate, mean", "reward"],
  value_explained_var: ["Value explained variance", "fraction"],
  cuda_peak_mb: ["Peak GPU memory", "MB"],
  optimizer_state_mb: ["Optimizer state memory", "MB"],
  grad_mb: ["Gradient memory", "MB"],
  activation_mb: ["Activation memory", "MB"],
};

// [title, unit] of a metric; an unknown key gets a readable title from its name (and no unit)
function metricLabel(key) {
  if (METRIC_LABELS[key]) return METRIC_LABELS[key];
  const words = key.replace(/_/g, " ").replace(/\bper s\b/, "per second");
  return [words.charAt(0).toUpperCase() + words.slice(1), ""];
}

window.TandemLabels = {metricLabel};
