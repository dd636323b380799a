"""Chain-of-thought, best-of-N and tree search: three callers of one mechanism, the fork.

Each declares a family (a trunk and how many branches will fork it) before anything runs, so the
trunk is computed once and stays pinned exactly as long as branches still need it.
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kmesh.engine.engine import Engine
from kmesh.engine.request import Request, RequestOutput, SamplingParams


@dataclass(frozen=True, slots=True)
class BranchResult:
    trunk: RequestOutput
    branches: list[RequestOutput]


def _seeded(params: SamplingParams, seed: int | None) -> SamplingParams:
    return replace(params, seed=seed)


def fork_branches(
    engine: Engine,
    name: str,
    prompt_ids: Sequence[int],
    branch_seeds: Sequence[int | None],
    branch_params: SamplingParams,
    trunk_params: SamplingParams | None = None,
    keep_logits: bool = False,
    tenant_salt: str | None = None,
) -> BranchResult:
    """Compute a trunk once (the prompt, then `trunk_params.max_tokens` generated tokens if
    given), then fork one branch per seed from where the trunk stopped."""
    trunk_id = f"{name}/trunk"
    engine.declare_family(name, trunk_id, len(branch_seeds))
    requests = [Request(trunk_id, tuple(prompt_ids), trunk_params, tenant_salt, retain=True)]
    requests += [
        Request(
            f"{name}/branch-{i}",
            (),
            _seeded(branch_params, seed),
            tenant_salt,
            parent_id=trunk_id,
            keep_logits=keep_logits,
        )
        for i, seed in enumerate(branch_seeds)
    ]
    trunk, *branches = engine.generate(requests)
    return BranchResult(trunk, branches)


def best_of_n(
    engine: Engine,
    name: str,
    prompt_ids: Sequence[int],
    seeds: Sequence[int],
    params: SamplingParams,
    keep_logits: bool = False,
) -> BranchResult:
    """N seeded samples of one prompt, the prompt computed once."""
    return fork_branches(engine, name, prompt_ids, seeds, params, None, keep_logits)


def chain_of_thought(
    engine: Engine,
    name: str,
    prompt_ids: Sequence[int],
    reasoning: SamplingParams,
    seeds: Sequence[int],
    params: SamplingParams,
    keep_logits: bool = False,
) -> BranchResult:
    """Generate a trunk of reasoning tokens, then fork N continuations from that point."""
    return fork_branches(engine, name, prompt_ids, seeds, params, reasoning, keep_logits)


@dataclass(frozen=True, slots=True)
class TreeResult:
    root: RequestOutput
    # Level-1 nodes, and for each its k leaves.
    nodes: list[RequestOutput]
    leaves: list[list[RequestOutput]]
    # (node index, leaf index) of the leaf whose path has the highest mean log-probability.
    best: tuple[int, int]


def mean_logprob(*outputs: RequestOutput) -> float:
    logprobs = [lp for out in outputs for lp in out.logprobs]
    return sum(logprobs) / len(logprobs)


def tree_search(
    engine: Engine,
    name: str,
    prompt_ids: Sequence[int],
    width: int,
    params: SamplingParams,
    seed: int = 0,
    keep_logits: bool = False,
) -> TreeResult:
    """Depth-2 search: the root forks `width` nodes, each node forks `width` leaves; every node
    and leaf samples `params.max_tokens` tokens. Keeps the leaf whose path (node tokens + leaf
    tokens) has the best mean log-probability."""
    root_id = f"{name}/root"
    node_ids = [f"{name}/node-{i}" for i in range(width)]
    engine.declare_family(name, root_id, width)
    for i, node_id in enumerate(node_ids):
        engine.declare_family(f"{name}/node-{i}", node_id, width)
    requests = [Request(root_id, tuple(prompt_ids), None, retain=True)]
    for i, node_id in enumerate(node_ids):
        requests.append(
            Request(
                node_id,
                (),
                _seeded(params, tree_seed(seed, i)),
                parent_id=root_id,
                retain=True,
                keep_logits=keep_logits,
            )
        )
    for i, node_id in enumerate(node_ids):
        for j in range(width):
            requests.append(
                Request(
                    f"{node_id}/leaf-{j}",
                    (),
                    _seeded(params, tree_seed(seed, i, j)),
                    parent_id=node_id,
                    keep_logits=keep_logits,
                )
            )
    root, *rest = engine.generate(requests)
    nodes = rest[:width]
    leaves = [rest[width + i * width : width + (i + 1) * width] for i in range(width)]
    best = max(
        ((i, j) for i in range(width) for j in range(width)),
        key=lambda ij: mean_logprob(nodes[ij[0]], leaves[ij[0]][ij[1]]),
    )
    return TreeResult(root, nodes, leaves, best)


def tree_seed(seed: int, node: int, leaf: int | None = None) -> int:
    """The seed of a tree node (leaf None) or leaf, the same in every strategy that replays it."""
    return seed * 1_000_003 + (node + 1) * 1009 + (0 if leaf is None else leaf + 1)
