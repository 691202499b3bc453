"""What `mdgan local`'s fork server imports once, before it forks the server and every worker.

The children share these pages copy-on-write instead of each importing torch, gRPC and the
services again (~300 MB and seconds per process). Nothing here starts a thread, an event loop or
a gRPC channel: forking stays safe.
"""

import gc

import torch

import services.server.__main__  # noqa: F401  (imported for its side effect: the modules are loaded)
import services.worker.__main__  # noqa: F401

# torch imports torch._dynamo (with sympy: ~900 modules, ~100 MB) when the first optimizer is
# built: pay for it here, once, rather than in every worker.
torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])

# Move every object loaded so far out of the collector's reach: a child's garbage collection then
# never writes to (and so never copies) the pages they live on.
gc.collect()
gc.freeze()
