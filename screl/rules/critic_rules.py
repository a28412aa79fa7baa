"""PPO's own rules (``Algorithm.rules``): the critic it trains, and its epochs and minibatches.

A run whose algorithm trains a critic needs the critic's model and value loss, keeps the policy optimizer off the
device while the critic runs, and splits each step's rows into equal minibatches every epoch.
"""

from __future__ import annotations

from screl.rules.context import RuleContext, get


def critic_rules(c: RuleContext) -> None:
    title = c.algorithm.title
    if get(c.cfg, "model.init_args.value") is None:
        c.bad("model.init_args.value", None, f"a {title} run needs a critic", "add model.init_args.value")
    if get(c.cfg, "model.init_args.value_loss_fn") is None:
        c.bad("model.init_args.value_loss_fn", None, f"a {title} run needs a value loss",
              "add model.init_args.value_loss_fn (screl.algos.ClippedValueLoss)")
    offload = get(c.cfg, "model.init_args.offload_optimizer_for_logprob")
    if offload is not None and not offload:
        c.bad("model.init_args.offload_optimizer_for_logprob", False, f"{title} keeps the policy optimizer off "
              "the device while the critic runs", "set it to true")
    _epoch_rules(c)


def _epoch_rules(c: RuleContext) -> None:
    key = c.algo_key
    knobs = {k: getattr(c.algo_cfg, k) for k in ("ppo_epochs", "critic_ppo_epochs", "num_minibatches")}
    for knob in ("ppo_epochs", "critic_ppo_epochs"):
        if knobs[knob] < 1:
            c.bad(f"{key}.{knob}", knobs[knob], "must be >= 1", f"set {key}.{knob} >= 1")
    minibatches, rows = knobs["num_minibatches"], c.P * c.G
    if not isinstance(minibatches, int) or minibatches < 1 or rows % minibatches:
        divisors = [d for d in range(1, rows + 1) if rows % d == 0]
        c.bad(f"{key}.num_minibatches", minibatches, f"must be >= 1 and divide the step's num_prompts_per_step x "
              f"num_generations_per_prompt = {c.P} x {c.G} = {rows} rows (each epoch splits them into equal "
              "minibatches)", f"set it to one of {divisors}")
