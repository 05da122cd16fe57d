"""The native extension ``fastdcp._C``, reached by every module of the package through here.

This is the package's bottom module: it imports nothing of fastdcp but the extension and
``_extension_error``, so any stage (``format/`` included) may import it without reaching up to the
package's ``__init__``. Where the extension cannot be loaded (none built, built for another Python,
a shared library missing), importing this module raises one ImportError saying which file, which
torch it was built against and how to rebuild (``fastdcp/_extension_error.py``).
"""

from __future__ import annotations

try:
    from . import _C
except ImportError as _exc:
    from pathlib import Path as _Path

    import torch as _torch

    from ._extension_error import import_failure_message

    raise ImportError(import_failure_message(_exc, _Path(__file__).parent, _torch.__version__,
                                             _torch.version.cuda)) from _exc

__all__ = ["_C"]
