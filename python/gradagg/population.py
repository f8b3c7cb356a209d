"""Population mode: every member its own weights, optimizer and hyperparameters.

``gradagg.Population`` forks ``workers`` members, each training its own copy of
``model`` with its own Python optimizer. Every ``publish_interval`` steps each
member publishes its weights, buffers, score, hyperparameters and optimizer
state (its ``state_dict()``) into shared memory, where every member and the
parent read any member's latest complete snapshot without blocking it; then a
policy decides, in each member, whether it copies a better peer (exploit: the
weights, the optimizer state and the hyperparameters) and perturbs what it
copied (explore)::

    model = torch.nn.Linear(784, 10)
    def train_step(ctx):                   # in member ctx.rank, on its copy of model
        i = ctx.rng.below(len(x) - 64)
        ctx.optimizer.zero_grad()
        F.cross_entropy(model(x[i:i + 64]), y[i:i + 64]).backward()
        ctx.optimizer.step()
    with gradagg.Population(
            model, workers=4, publish_interval=100, seed=1, higher_is_better=True,
            make_optimizer=lambda hp: torch.optim.SGD(model.parameters(), lr=hp["lr"]),
            hyperparams=lambda rank, rng: {"lr": 10 ** (-4 + 4 * rng.uniform())},
            train_step=train_step, score=lambda ctx: accuracy(model, xv, yv),
            policy=gradagg.Policy.truncation(0.25), lineage_path="lineage.jsonl") as pop:
        for _ in range(20):
            pop.generation()
        best = max(range(pop.workers), key=lambda r: pop.snapshot(r).score)
        model.load_state_dict(pop.state_dict(best))

Every draw comes from a ``DecisionRng`` derived from (seed, rank, step), so a
run is reproducible, and ``checkpoint(path)`` + ``resume_from=path`` resumes it
bit for bit. The C++ class and its guarantees: docs/population.md.
"""

from collections import OrderedDict

from gradagg._core import (CopyEvent, DecisionRng, MemberContext, MemberSnapshot,  # noqa: F401
                           Policy, PolicyInput, _Population)
from gradagg.errors import InvalidArgument

__all__ = ["Population", "Policy", "PolicyInput", "DecisionRng", "MemberContext", "CopyEvent",
           "MemberSnapshot"]


class Population(_Population):
    """Forks ``workers`` members, each training its own copy of ``model``.

    Functions (``ctx`` is a ``MemberContext``: ``rank``, ``workers``, ``step``
    (steps this member trained so far), ``hyperparams``, ``optimizer``,
    ``rng``; valid during the call):

    - ``make_optimizer(hp)``: the member's ``torch.optim`` optimizer over
      ``model.parameters()`` (in the member, so over its copy);
    - ``hyperparams(rank, rng)``: each rank's initial dict of str -> float,
      in the parent before the fork, the same names for every rank;
    - ``train_step(ctx)``: one step (zero_grad, forward, backward,
      ``ctx.optimizer.step()``);
    - ``score(ctx)``: the member's score at a publish point (a float);
    - ``init_weights(rank, rng)``: optional, per-member initial weights (not
      on resume);
    - ``apply_hyperparams(optimizer, hp)``: optional; after a copy and on
      resume (default: every param group's ``lr`` = ``hp["lr"]``).

    ``policy``: a ``Policy`` (``none()``, ``random(p)``, ``truncation(f)``,
    ``tournament()``, ``custom(name, fn)``) or a callable ``fn(input, rng)`` that
    returns the donor's rank or -1. Options, as in C++'s PopulationOptions:
    ``workers=4``, ``publish_interval=10``, ``seed=0``,
    ``higher_is_better=False``, ``ready_interval=0``,
    ``copy_optimizer_state=True``, ``copy_hyperparams=True``,
    ``explore="perturb"`` (x0.8 or x1.2 each; ``"none"``; ``"resample"`` with
    ``resample(hp, rng) -> dict``), ``optimizer_state_bytes=1 << 20``,
    ``lineage_path=""`` (one JSON line per copy), ``resume_from=""``,
    ``threads_per_worker=0``, ``keep_worker_memory=True`` (each member keeps the
    memory its steps free, as the Aggregator's workers), ``step_timeout=300.0`` and
    ``shutdown_timeout=2.0`` (seconds), ``max_restarts=0``.

    Raises ``InvalidArgument`` for bad input; ``generation()`` raises
    ``WorkerFailed`` (the member's exception and traceback), ``WorkerDied``
    (unless ``max_restarts`` forks it again from its latest snapshot) or
    ``StepTimeout``, and ``NotUsable`` afterwards.
    """

    def __init__(self, model, *, make_optimizer, hyperparams, train_step, score,
                 init_weights=None, apply_hyperparams=None, policy=None, **options):
        if policy is None:
            policy = Policy.none()
        elif not isinstance(policy, Policy):
            if not callable(policy):
                raise InvalidArgument(f"policy: expected a gradagg.Policy or a callable, got "
                                      f"{type(policy).__name__}")
            policy = Policy.custom(getattr(policy, "__name__", "custom"), policy)
        self._parameter_names = [name for name, _ in model.named_parameters()]
        self._buffer_names = [name for name, _ in model.named_buffers()]
        super().__init__(model, make_optimizer, hyperparams, train_step, score, init_weights,
                         apply_hyperparams, policy, **options)

    def state_dict(self, rank):
        """Member ``rank``'s latest weights and buffers by name, for ``load_state_dict``."""
        s = self.snapshot(rank)
        out = OrderedDict(zip(self._parameter_names, s.parameters))
        out.update(zip(self._buffer_names, s.buffers))
        return out

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
        return False

    def __repr__(self):
        return f"Population(workers={self.workers}, policy={self.policy_name})"
