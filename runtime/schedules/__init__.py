"""fxpipe.runtime.schedules: what every rank does, as data (pure Python, no torch).

The action IR (``schedule``, ``order``); the kinds' generators (``kinds``, ``zerobubble``,
``placement``, ``placed_orders``, ``localsgd``), a stretch in windows (``stream``) and what
``schedule=`` accepts (``spec``); what a schedule implies (``staleness``, ``simulate``); the
message order and its proofs (``commplan``, ``hosted_plan``, ``ncclcheck``, ``proofs``); a rank's
window lowered to its program of actions, posts and waits (``program``).
"""
