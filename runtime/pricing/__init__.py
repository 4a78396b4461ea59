"""fxpipe.runtime.pricing: what a plan costs on a cluster; choosing and re-choosing a plan.

Event simulation of a plan under a schedule (``core``, ``plansim``, ``placed_sim``), the
steady-state reduction of its timeline (``sim_measure``), the choice among candidate plans
(``plan_choice``) and re-planning from measured stage times (``replan``). Imports ``schedules``;
never ``replica`` (no torch is needed to price a plan).
"""
