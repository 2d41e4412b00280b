"""The backend face: what the dispatcher reads of `elastic_np.reference`, `elastic_np.cpu` and `elastic_np.cuda`."""

from typing import Optional, Protocol, runtime_checkable


@runtime_checkable
class Backend(Protocol):
    """A backend of `elastic_np.attention`: a module with these names.

    The second-order VJP, ``double_backward``, is `OPTIONAL`. The reference computes in float64 whatever the input dtype; the kernels
    keep the input dtype (the CPU kernels compute in float32 for bfloat16 and
    float16). The reference's face is ``reference/_backend.py``, kept out of
    ``reference.__all__``.

    Attributes
    ----------
    dtypes : tuple of str or None
        The names of the dtypes of ``q``, ``k``, ``v`` it takes; None: any
        real float, computed in float64 (the reference).
    """

    dtypes: Optional[tuple]

    def is_available(self) -> bool:
        """Whether it can run here."""

    def check_available(self) -> None:
        """Raise `~elastic_np.BackendUnavailableError` saying what is missing, if anything."""

    def prepare(self, q, k, v, **options):
        """The validated `~elastic_np._contract._problem.AttentionProblem`, with the signature of
        `elastic_np._contract._problem.prepare` (the CPU backend leaves the check of the bias's
        values to its kernels, which read every entry anyway; the CUDA backend keeps device
        arrays on the device)."""

    def check_backward_arrays(self, problem, dout, out, lse, dtype=None, dlse=None):
        """``dout``, ``out``, ``lse`` and ``dlse`` checked against the problem, as the backward reads them."""

    def forward(self, problem):
        """``(out, lse)``."""

    def backward(self, problem, dout, out, lse, dlse=None):
        """`~elastic_np.AttentionGrads` (``dlse``, the cotangent of ``lse``: None for zeros)."""


#: The names of the face, in the order the dispatcher uses them.
FACE = ("dtypes", "is_available", "check_available", "prepare", "check_backward_arrays", "forward", "backward")
#: What a backend may have besides: ``double_backward(problem, dout, out, lse, dlse, direction)``,
#: ``(ddout, ddlse, AttentionGrads)``, the second-order VJP along ``direction``
#: (`elastic_np._contract._grads.Direction`, the cotangents of the backward's outputs).
#: ``planned_forward(problem, like)``, ``run(q, k, v) -> (out, lse)``: ``forward`` of the problem for any arrays of
#: its shapes and dtype, their values checked as a call in full checks them, what it derives from the fields derived
#: once (`elastic_np._api.plans`);
#: ``like``, None or the ``run`` of a problem that differs in its number of keys alone.
OPTIONAL = ("double_backward", "planned_forward")
