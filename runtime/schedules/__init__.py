"""fxpipe.runtime.schedules: what every rank does, as data. No torch.

The action IR and its checks (``schedule``), the generators of every schedule kind (``kinds``,
``zerobubble``, ``placement``, ``placed_orders``, ``localsgd``), what a user may ask for
(``spec``), what the schedule implies (``staleness``, ``simulate``) and the one global message
order that keeps NCCL safe (``commplan``, ``hosted_plan``). Imports only the runtime's shared
leaves (``errors``, ``timeline``) and the compiler phases' plain data.
"""
