"""fxpipe.runtime.pricing: what a plan costs on a cluster; choosing and re-choosing a plan.

Simulation in ``core``, ``plansim``, ``placed_sim`` and ``sim_measure``; memory in ``memory`` and
``memory_walk``; the choice among candidates in ``plan_choice``; planning, a Profile in and a
Plan out, in ``choose``, its memory cap held against walked peaks in ``peak_fit``; re-planning
in ``replan``.
"""
