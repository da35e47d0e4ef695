"""Triton's CPU interpreter (``TRITON_INTERPRET=1``) made to run our kernels, for the scripts and
tests that check them without a GPU.

Triton 3.6's interpreter turns a loaded scalar (a 1-element array) used as a loop bound into an
index with ``int(array)``, which NumPy 2.4 and later refuse for arrays of one dimension: every
kernel that loops to a length it loads (the paged decode kernels, their forms) then fails under the
interpreter, though it compiles and runs on a GPU. :func:`fix_numpy_2_4` reads the element instead.

Not fixed, to know when reading its errors: the interpreter's float32 -> e4m3 conversion is wrong
where rounding carries into the exponent (7.92 becomes 4.0, 124.6 becomes 64.0; torch and the GPU's
``cvt`` give 8.0 and 128.0), about 5% of uniformly drawn values. A kernel that converts to e4m3 in
registers (``q``'s two terms in the FP8 scores kernel and the forms) therefore shows errors of a
few percent under the interpreter that it does not have on a GPU; a second term absorbs most of it.
"""

from __future__ import annotations

__all__ = ["fix_numpy_2_4"]


def fix_numpy_2_4() -> None:
    """Patch the interpreter (idempotent in effect); call after ``TRITON_INTERPRET=1`` is set and
    before a kernel first runs."""
    import triton.runtime.interpreter as interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "reads_one_element", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.reads_one_element = True
    interpreter._patch_lang_tensor = patched
