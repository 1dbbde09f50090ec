"""The registry of exploration methods: one `Method` per name of `algorithm.exploration`.

A method is at most four small pure functions, each optional but the first:
  rewards   (Group, algo) -> Signal: shaped rewards r̃, advantages A and novelty ν of every group [P, m]
  tokens    (Tokens, algo) -> TokenTerms: per-token weights / penalties of one mini-batch's policy loss, decided
            inside each update on the current policy's log-probs and entropies (Clip-Cov, KL-Cov, forking tokens)
  keep_rows (correct_B) -> keep_B: responses that stay in the loss (NSR trains on its negative samples only); the
            others are dropped: out of every mean, and a mini-batch with none left takes no optimizer step
  check     (cfg) -> (key, message) or None: what the method needs of the rest of the configuration
and a few flags (`needs`: extra inputs of `rewards`; `ppo_clip`: whether the loss clips the ratio; `novelty`:
ν is defined, so the trainer logs it and what single-class groups give their most and least novel response;
`token_weights`: `rewards` also returns per-token weights of the loss, decided once per step on the behaviour
policy (Miner's focal credit), where a token rule decides them per mini-batch on the current one).

    register(Method("my_method", "one line: the paper and what it changes", rewards=my_rewards))
    get("my_method").rewards(group, algo)

`train/step.py` (advantages, LossSettings, update), `token_terms` below and `train/update_rounds.py` (keep_rows)
dispatch through `get`;
`algorithm.exploration` accepts exactly the registered names (`NAMES`). A new method is one file in this package,
imported by `g2rl_jax/methods/__init__.py`, plus its knobs (if any) in `AlgorithmConfig`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Callable, Optional

import jax

if TYPE_CHECKING:
    from g2rl_jax.config import AlgorithmConfig, Config


@dataclasses.dataclass(frozen=True)
class Group:
    """A step's responses regrouped by prompt, [P, m] (m = group size): base rewards r and their correctness, and
    what a method may ask for (`Method.needs`): Φ [P, m, D] (always there), EVOL's embeddings [P, m, E] and
    validity, and under the behaviour policy each response's mean token log-prob (`seq_logp`) and every token's
    log-prob with the response mask (`token_logp`, `token_mask` [P, m, T], 0 past a response's end)."""

    rewards: jax.Array
    correct: jax.Array
    phi: jax.Array
    embeddings: Optional[jax.Array] = None
    valid: Optional[jax.Array] = None
    seq_logp: Optional[jax.Array] = None
    token_logp: Optional[jax.Array] = None
    token_mask: Optional[jax.Array] = None


@dataclasses.dataclass(frozen=True)
class Signal:
    """A method's output for every group [P, m]: shaped rewards (what the step logs as `reward`), advantages, and
    novelty ν (NaN where the method has none); for a method with `token_weights`, the weight [P, m, T] of each
    token's policy-gradient loss (≥ 0, so the same as scaling that token's advantage)."""

    shaped: jax.Array
    advantages: jax.Array
    nu: jax.Array
    token_weight: Optional[jax.Array] = None


@dataclasses.dataclass(frozen=True)
class Tokens:
    """One mini-batch's rows [X] / [X, T] for a token rule: advantages, the current policy's log-probs and
    entropies (π_θ, the params this update starts from; constants), the behaviour log-probs (π_old, of the ratio
    ρ = π_θ/π_old), the response mask (0 on rows out of the loss), and a PRNG key for rules that draw at random."""

    advantages: jax.Array
    logp: jax.Array
    entropy: jax.Array
    old_logp: jax.Array
    mask: jax.Array
    key: jax.Array


@functools.partial(jax.tree_util.register_dataclass, data_fields=["weight", "abs_log_ratio"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class TokenTerms:
    """Per-token terms [X, T] of the policy loss (None: not used): `weight` multiplies a token's policy-gradient
    loss; `abs_log_ratio` is the coefficient of |log ρ| added to it (KL-Cov's penalty)."""

    weight: Optional[jax.Array] = None
    abs_log_ratio: Optional[jax.Array] = None


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    summary: str  # one line: the paper (title, arXiv id) and what the method changes
    rewards: Callable[[Group, "AlgorithmConfig"], Signal]
    tokens: Optional[Callable[[Tokens, "AlgorithmConfig"], TokenTerms]] = None
    keep_rows: Optional[Callable[[jax.Array], jax.Array]] = None
    check: Optional[Callable[["Config"], Optional[tuple[str, str]]]] = None
    needs: frozenset = frozenset()  # of NEEDS
    ppo_clip: bool = True
    novelty: bool = False
    token_weights: bool = False


# What a method may need besides Φ and the rewards: "embeddings" (an external embedding model's, of every response:
# Group.embeddings, and the EVOL embedder program), "seq_logp" (the behaviour log-probs of the scoring pass:
# Group.seq_logp, token_logp, token_mask), "entropy" (the entropy term of the loss, -algorithm.entropy_coef · H).
NEEDS = ("embeddings", "seq_logp", "entropy")
# The algorithm key that only the methods with a need read, and its value when off: any other method must leave it
# there (config_groups.AlgorithmConfig); a method with the need says in its `check` what it needs of the key.
NEED_KEYS = {"embeddings": ("embedding_model", None), "entropy": ("entropy_coef", 0.0)}

REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    if method.name in REGISTRY:
        raise ValueError(f"exploration method {method.name!r} is registered twice")
    if not method.needs <= set(NEEDS):
        raise ValueError(f"exploration method {method.name!r} needs {sorted(method.needs)}; known needs: {NEEDS}")
    if method.token_weights and method.tokens is not None:
        raise ValueError(f"exploration method {method.name!r} has both a token rule and per-step token weights; "
                         "give it one of the two")
    REGISTRY[method.name] = method
    return method


def get(name: str) -> Method:
    """The method registered as `name` (ValueError naming the registered ones otherwise)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown exploration method {name!r}; choose one of {', '.join(REGISTRY)}")
    return REGISTRY[name]


@functools.partial(jax.jit, static_argnames=("algo", "mini_batch_size"))
def token_terms(advantages_B, logp_BxT, entropy_BxT, old_logp_BxT, mask_BxT, key, *, algo: "AlgorithmConfig",
                mini_batch_size: int) -> TokenTerms:
    """The configured method's per-token loss terms [B, T] (Method.tokens; empty TokenTerms for the methods without
    a token rule), decided on each mini-batch of `mini_batch_size` consecutive rows from the current policy's
    log-probs and entropies, the behaviour log-probs, the advantages and the response mask of the rows in the loss;
    `key` for rules that draw. train/step.py's `update` calls it once per update, on that update's mini-batch."""
    rule = get(algo.exploration).tokens
    if rule is None:
        return TokenTerms()
    b, t = mask_BxT.shape
    n = b // mini_batch_size

    def per_mini(x):
        return x.reshape(n, mini_batch_size, *x.shape[1:])

    def one(adv_X, logp_XxT, ent_XxT, old_XxT, mask_XxT, key):
        return rule(Tokens(adv_X, logp_XxT, ent_XxT, old_XxT, mask_XxT, key), algo)

    logp_BxT, entropy_BxT = jax.lax.stop_gradient((logp_BxT, entropy_BxT))
    terms = jax.vmap(one)(per_mini(advantages_B), per_mini(logp_BxT), per_mini(entropy_BxT), per_mini(old_logp_BxT),
                          per_mini(mask_BxT), jax.random.split(key, n))
    return jax.tree.map(lambda x: x.reshape(b, t), terms)


def token_fields(algo: "AlgorithmConfig") -> tuple[bool, bool]:
    """Which per-token loss terms the configured method sets, from its token rule or (weight only) from its
    rewards (`Method.token_weights`): (weight, abs_log_ratio), e.g. to lower its update ahead of time."""
    method = get(algo.exploration)
    rule = method.tokens
    if rule is None:
        return method.token_weights, False
    x = jax.ShapeDtypeStruct((2, 2), jax.numpy.float32)
    terms = jax.eval_shape(lambda *a: rule(Tokens(*a), algo), x.update(shape=(2,)), x, x, x, x,
                           jax.eval_shape(lambda: jax.random.key(0)))
    return terms.weight is not None, terms.abs_log_ratio is not None
