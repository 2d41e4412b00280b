"""The decode kernels' calls kept by a plan (`elastic_np._api.plans`, `elastic_np._api.paged_plans`): the schedule
and the launch made once per layout of the keys, and again only when the config changes
(`elastic_np.cpu._runtime.config.GENERATION`)."""

from elastic_np._contract import _validation
from elastic_np.cpu._decode import decode
from elastic_np.cpu._decode.plan import schedule, takes_rows
from elastic_np.cpu._decode.tiles import _paged_rows
from elastic_np.cpu._runtime import config
from elastic_np.cpu._tiles.cache_scales import fine_operands
from elastic_np.cpu._tiles.operands import operand
from elastic_np.cpu._tiles.pages import pool_operand


def contiguous(problem, otherwise, like=None):
    """`forward` of ``problem`` (no pages) as ``run(q, k, v) -> (out, lse)``, for any ``q``, ``k``, ``v`` of its
    shapes and dtype, their values checked (those of the keys and values left to the kernel as `forward` leaves
    them, and ``q``'s to the stacked-rows kernel: `_check_unread_cache`): the schedule and what the kernels'
    call derives from it made once per layout of the keys.

    ``otherwise``: ``run(q, k, v)`` of the prefill kernels, which a run calls where the decode kernels do not
    take the problem (`elastic_np.cpu._decode.plan.takes_rows`, asked on every run: the config may change).
    ``like``: the ``run`` of a problem that differs from this one in its number of keys alone, whose
    kernels' entry points, the same for both, this one takes over (`_launcher`).
    """
    launchers = {}
    kin_launchers = {} if like is None else like.launchers  # not ``like``, whose problem and kin would stay
    B, H, Hkv, N, M, D, Dv = problem.shape
    rows = (H // Hkv) * N
    fine = fine_operands(problem)  # None, or `NO_FINE`: per-token and per-group scales are arrays, never planned

    def run(q, k, v):
        if not takes_rows(N, rows):
            return otherwise(q, k, v)
        q_operand, k_operand, v_operand = operand(q), operand(k), operand(v)
        key = (k_operand[1], config.GENERATION)  # the schedule follows the config
        launch = launchers.get(key)
        if launch is None:
            plan = schedule(problem, k_operand[1], None, None)
            kin = kin_launchers.get(key)
            launch = launchers[key] = decode._launcher(problem, plan, direct=True, like=kin)
        kind = launch.kind
        if kind[0]:  # key-major: its products are not checked: q is, here
            _validation.check_finite(q, "q")
            return launch(q_operand, k_operand, v_operand, decode.CONTIGUOUS_PAGES[kind], (k, v), fine)
        return launch(q_operand, k_operand, v_operand, decode.CONTIGUOUS_PAGES[kind], (k, v), fine, q_operand[0])

    run.launchers = launchers
    return run


def paged(problem, block_size, entry_splits):
    """`forward` of ``problem`` over pages of ``block_size`` keys with ``entry_splits``, as
    ``run(q, k_pages, v_pages, table, scale_pages=None) -> (out, lse)``, for any ``q`` and pools of its shapes
    and dtype and the int64 C-contiguous ``table`` it was checked with (`elastic_np._api.paged_plans`);
    ``scale_pages``: `decode.forward`'s."""
    launchers = {}

    def run(q, k_pages, v_pages, table, scale_pages=None):
        q_operand = operand(q)
        k, v = pool_operand(k_pages), pool_operand(v_pages)
        key = (k[1], config.GENERATION)
        launch = launchers.get(key)
        if launch is None:
            plan = schedule(problem, k[1], block_size, entry_splits)
            launch = launchers[key] = decode._launcher(problem, plan, direct=True)
        cache = [_paged_rows(a, table) for a in (k_pages, v_pages)] if problem.kv_unchecked else None
        return launch(q_operand, k, v, (table, block_size, launch.kind[1]), cache,
                      fine_operands(problem, scale_pages))

    return run
