"""Why each argued survivor of ``bench/mutation.py`` is equivalent, in one line each.

Keyed by (module, stripped original line, mutated line), so a rerun after a code change shows
which arguments no longer apply (the report marks a survivor without one as a missing test).
"""
from __future__ import annotations

# (module, stripped original line, mutated line) -> why the mutant is equivalent: it changes no
# result any caller can observe. Filled in from the survivors of a run, each argued in one line.
_UNREAD = "the extra element is never read"
_ANNOTATION = "an annotation: a string under `from __future__ import annotations`, never evaluated"
_STALL = ("`stalled` starts at a value no (progress, time) pair reaches (progress counts up "
          "from its start, time is >= 0), and progress is only compared with itself")
_NOT_F = ("dep() treats every kind but \"F\" alike (B's and W's dependencies), so a wrong name "
          "for B is still not F")
_BRACKET = ("another first bracket: ok(lo) is still false and ok(hi) true (ok is monotone), and "
            "the bisection ends on the same adjacent floats")
_INIT = ("the field becomes an optional constructor argument no caller passes; __post_init__ "
         "or start() sets it before any use")
_STARTED = ("start() sets it before any use, and every round (ready, finish) begins with "
            "start() (runtime/executor.py)")
_CAT = ("torch.cat in flat() promotes over its parts, which hold every bucket's dtype, so the "
        "count's dtype before the cat never decides the result's")
_ALIAS = ("a type alias used only in annotations (strings under `from __future__ import "
          "annotations`, or a local variable's, never evaluated)")
_PATH = ("search path only: which exact checks the bisection makes, not where it ends (the same "
         "plan); only the reported `checks` may differ")
_ALL_FIELDS = ("a default no Solution uses: feasibility's evaluate() passes every field "
               "(positionally) and solve() copies one")
_INDEX0 = ("index 0 (r = 0 replicas) is never read: replica counts run 1..workers, as for "
           "gamma's index 0")
_PROGRESS = ("`progress` is only compared with values it had before (`stalled` starts empty): "
             "any start and any step that keeps its successive values distinct give the same "
             "comparisons")
_NO_REACH = ("returned only when no start reaches `need` = best + 1, and the one caller "
             "(check_budget_rc) takes a result only if `e > best`: any value below best + 1 "
             "and any (start, flag) with it are ignored alike")
_DEP_END_B = ("dep_end() tests only kind == \"F\" and treats every other kind as a B (its "
              "input: B on s + 1, or F on the last stage), so another name for B gives the same time")
_OWN_RANK = ("this input is made by the action's own rank (its B for a W, its F for the last "
             "stage's B), so on its own process: the comm term is never added and cut never read")
_PREFILTER = ("a pruning filter only: a weaker one lets through starts that cannot reach `need`; "
              "reach_many is exact (time and memory), so they reach less than need = best + 1, "
              "and the caller takes a result only if `e > best`")
_WITNESS_EXISTS = ("x is in E[s][k] and not in E[s][k - 1], so some r <= k, start in E[s-1][k-r] "
                   "and flag reach x: the same IEEE expressions then accept [a, x), and `found` is "
                   "a tuple whenever it is read")
_NO_S = ("backtrack_layers never reads an \"s\" entry: it starts at budget m of the last layer "
         "(changed there: prev[m] < n <= cur[m]); an \"r\" step goes to budget kp = k - r of the "
         "layer below, which was in `changed`, i.e. changed in that layer (an \"r\" or \"k\" "
         "entry; layer 1's step ends the walk at start 0); a \"k\" step to k - 1 of its own layer, "
         "raised there (cur[k-1] > cur[k] >= prev[k] >= prev[k-1])")
_K_FIELDS = ("backtrack_layers reads only the kind of a \"k\" entry (it lowers k): its fields "
             "are unused")
_NEVER_LOWER = ("never runs: the r pass leaves cur nondecreasing (prev is, by induction over "
                "layers). An unchanged cur[k-1] = prev[k-1] <= prev[k]; one that a stage (kp, r) set "
                "(kp + r = k - 1) is matched at budget k by (kp + 1, r), from the same or more starts "
                "at an in-flight count no larger: in this layer if kp + 1 changed, else in the last "
                "layer where it did (layer 1 tries every kp; the same prev[kp + 1]), a reach prev[k] "
                "keeps (a budget already at >= n is skipped, and is >= cur[k-1] anyway)")
_PREV_BELOW_N = ("never true: prev (the layer before) is nondecreasing and that layer returned "
                 "when cur[m] >= n, so every prev[kp] < n (reaches are <= n)")
_NEED = ("_best_reach returns -1 or an end >= need = best + 1 (best >= 0): `e >= best` holds "
         "exactly when `e > best` does")
_COLUMN_N = ("column n of cutm is never read: the checks slice ok[r, :x_end + 1] with "
             "x_end <= n - 1 and la_ok[r, :n] / [:x] with x <= n, cut_values takes [1:n], and "
             "_LastAllowed answers x >= n before its row, whose prefix maximum at x < n ignores "
             "index n")
# passes/feasibility.py (its line numbers below are the saved run's; _Inst.fits was dropped since)
_F = "passes/feasibility.py"
_GUESS = ("search path only: _search's answer is fixed by its exact predicate f (monotone; true at "
          "start = max(a, lo): f(a) is an empty stage, 0 s <= tau and 0 B <= cap, and a hint lo "
          "passes both, checked by the caller), so another first guess (any key or lim: the guess "
          "is clamped into [start, n]), step count or switch to bisection changes only which e "
          "are probed, not the last e with f(e) (checked on 40000 random keys, hints and "
          "boundaries, unsorted, inf and NaN keys included)")
_MID = ("(lo + hi + 2) // 2 lies in (lo, hi] whenever lo < hi, so the bisection still keeps f(lo) "
        "true and f(hi + 1) false and ends on the same last e with f(e)")
_START_TRUE = ("f(start) is true for every caller (f(a) is an empty stage, 0 s <= tau and 0 B <= "
               "cap; a hint lo passes both, checked by the caller), so the walk down stops at "
               "start either way")
_LO_DEFAULT = "start = max(a, lo) with a >= 0: a default of -2 gives start = a, as -1 does"
_CACHE = ("a cache only: the key is recomputed from the same expression (the same IEEE values) "
          "at each call")
_MEM_AT_CAP = ("a stage whose memory at et equals the cap goes to the memory search instead, whose "
               "predicate holds at et and below, so em >= et and min(et, em) = et: (et, et) again")
_X0 = ("at x = 0 the scan returns (0, INF) at its first step (p <= 0) and a cached row gives "
       "row[0] = 0 with a == x: (0, INF), as the early return does")
_LA_PATH = ("which path answers (the 16-step scan or the whole row) only: both give the last "
            "p <= x with cut cost <= t (the same IEEE products cbl[p] * g and cutm[r, p]; p = 0 "
            "is returned at once, cutm[:, 0] = 0); their rejected minima differ only where a cost "
            "is NaN (0 * inf): with gamma_r = 0 every finite cut costs 0 and is allowed, so all "
            "rejected costs are NaN, with gamma_r = inf all are inf or NaN, and the one reader, "
            "check_budget's `rejected < nxt`, ignores inf and NaN alike")
_P0 = ("at p = 0 the cost is cbl[0] * g = 0 * g: 0 <= t (tau >= 0) returns (0, rejected) as "
       "before; if NaN (g = inf) it is neither allowed nor below `rejected`, and p = -1 then "
       "returns (0, rejected)")
_TIE = "a tie stores the value the variable already holds"
_HINT = ("a search hint only: reach's start becomes max(a, best - 1), where both predicates hold "
         "(they hold at best + 1, checked just above, and are monotone): " + _GUESS)
_NEED_REACH = ("reach's hint best + 1 passes both predicates (checked just above), so it returns "
               "an end >= best + 1: `e >= best` holds exactly when `e > best` does")
_KP_ASCENDING = ("inst.rs is ascending: once kp + r > m every later r's budget is too, and "
                 "`continue` skips them all")
_ANY_KIND = ("backtrack_layers tells entries apart only by \"k\" and \"s\": any other kind is "
             "a stage")
_NEVER_LOWER_FS = ("never runs: the r pass leaves cur nondecreasing (prev is, by induction over "
                   "layers). An unchanged cur[k-1] = prev[k-1] <= prev[k]; one that a stage "
                   "(kp, r) set (kp + r = k - 1) is matched at budget k by (kp + 1, r), which "
                   "starts no earlier (la(r, x) grows with x, prev[kp + 1] >= prev[kp]) at an "
                   "in-flight count no larger, so reaches as far: in this layer if kp + 1 changed, "
                   "else in the last layer where it did (layer 1 tries every kp; the same "
                   "prev[kp + 1]), a reach prev[k] keeps (a budget already at >= n is skipped, "
                   "and is >= cur[k-1] anyway)")
_NO_K = ("no \"k\" entry ever exists: the budget pass that writes them never runs in either "
         "caller (fewest_stages: " + _NEVER_LOWER_FS + "; fewest_stages_rc likewise, argued "
         "for recompute.py)")
_SKIP_NONE = ("a visited stage entry (a, r) never starts at x, the next stage's start (x <= e, "
              "this entry's reach): if x == a, then a <= R_{s-2}(k - r) <= R_{s-2}(k) < e (the "
              "entry raised budget k), so the next stage (start x on r' replicas, budget k + r', "
              "the same in-flight count) is also tried one layer lower from budget k "
              "(fewest_stages: la(r', R_{s-2}(k)) = x, as no start in (x, e] is allowed for r'; "
              "fewest_stages_rc tries every allowed start <= R_{s-2}(k)) and reaches n there: "
              "the check would have returned a layer earlier")
EQUIVALENT: dict[tuple[str, str, str], str] = {
    ("passes/cuts.py", "if j > last[i]:", "if j >= last[i]:"):
        "when j == last[i] it stores the same j again",
    ("passes/cuts.py", "if n <= 1:", "if n < 1:"):
        "for n = 1 the general path also returns an empty float array",
    ("passes/cuts.py", "diff = np.zeros(n + 1)", "diff = np.zeros(n + 2)"):
        _UNREAD + " (the prefix sum is sliced [1:n])",
    ("passes/cuts.py", "bad = np.zeros(n + 1, dtype=np.int64)",
     "bad = np.zeros(n + 2, dtype=np.int64)"): _UNREAD + " (the prefix sum is sliced [1:n])",
    ("passes/reference_dp.py", "best = [[math.inf] * (workers + 1) for _ in range(n + 1)]",
     "best = [[math.inf] * (workers + 2) for _ in range(n + 1)]"): _UNREAD,
    ("passes/reference_dp.py", "best = [[math.inf] * (workers + 1) for _ in range(n + 1)]",
     "best = [[math.inf] * (workers + 1) for _ in range(n + 2)]"): _UNREAD,
    ("passes/reference_dp.py", "best[0] = [0.0] * (workers + 1)",
     "best[0] = [0.0] * (workers + 2)"): _UNREAD,
    ("passes/reference_dp.py", "comp, par = [0.0] * j, [0.0] * j",
     "comp, par = [1.0] * j, [0.0] * j"): "every entry is overwritten by the loop below before "
                                           "it is read",
    ("passes/reference_dp.py", "comp, par = [0.0] * j, [0.0] * j",
     "comp, par = [0.0] * j, [1.0] * j"): "every entry is overwritten by the loop below before "
                                           "it is read",
    ("passes/reference_dp.py", "if i > 0 and m - r < 1:", "if i > 1 and m - r < 1:"):
        "the break only skips candidates built on best[i][0] = inf (i > 0), which never win",
    ("passes/reference_dp.py", "if i > 0 and m - r < 1:", "if i > 0 and m + r < 1:"):
        "the break only skips candidates built on best[i][0] = inf (i > 0), which never win",
    ("passes/reference_dp.py", "break  # the stages before i need at least one worker",
     "continue  # the stages before i need at least one worker"):
        "the loop goes on through candidates built on best[i][0] = inf, which never win",
    ("passes/partition.py", "crossing = all_crossing_values(profile, [a for a in sol.starts if a > 0])",
     "crossing = all_crossing_values(profile, [a for a in sol.starts if a >= 0])"):
        "`crossing` only feeds a debug log line",
    ("passes/partition.py", "if a > 0:", "if a > 1:"): "only decides whether a debug line is logged",
    ("passes/partition.py",
     'f"no plan fits in {format_bytes(cluster.memory or 0)} per worker: the smallest-memory "',
     'f"no plan fits in {format_bytes(cluster.memory or 1)} per worker: the smallest-memory "'):
        "raised only under a memory cap, and Cluster refuses a cap <= 0: the `or` never applies",
    ("runtime/stash.py", "OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]",
     "OptimizerFactory = None"): "a type alias used only in annotations (strings under "
                                 "`from __future__ import annotations`)",
    ("runtime/stash.py", "_Slots = list[tuple[str, list[tuple[dict, str]]]]", "_Slots = None"):
        "a type alias used only in annotations (strings under `from __future__ import annotations`)",
    ("runtime/stash.py", "self.optimizer: torch.optim.Optimizer | None = (",
     "self.optimizer: torch.optim.Optimizer & None = ("): _ANNOTATION,
    ("runtime/stash.py", "if self._reads[v] > 0:", "if self._reads[v] >= 0:"):
        "a count driven below 0 is only ever compared `> 0`, like 0",
    ("runtime/stash.py", "copied = False", "copied = True"):
        "an in-place update adds no storage, so the peak it would re-take is already counted "
        "(the peak starts at bytes_held())",
    ("runtime/stash.py", "copied = False", "copied = None"): "None is falsy like False",
    ("runtime/stash.py", "reused = 0", "reused = 1"): "`reused` only feeds a debug log line",
    ("runtime/stash.py", "reused += 1", "reused = 1"): "`reused` only feeds a debug log line",
    ("runtime/stash.py", "reused += 1", "reused -= 1"): "`reused` only feeds a debug log line",
    ("runtime/stash.py", "reused += 1", "reused += 2"): "`reused` only feeds a debug log line",
    ("runtime/stash.py", "for mname, mod in gm.named_modules(remove_duplicate=False):",
     "for mname, mod in gm.named_modules(remove_duplicate=True):"):
        "a module reached under two names is one object with one dict: swapping (and restoring) "
        "its slot once or twice gives the same call",
    ("passes/solver.py", "_PROBE_LO_GAP = 1e-9", "_PROBE_LO_GAP = 2e-09"): _PATH,
    ("passes/solver.py", "lo, hi = max(0.0, lower * (1 - 1e-9)), best.bottleneck",
     "lo, hi = max(0.0, lower * (1 - 2e-09)), best.bottleneck"): _PATH,
    ("passes/solver.py", "if hi - lo <= _PROBE_LO_GAP * hi:",
     "if hi + lo <= _PROBE_LO_GAP * hi:"): _PATH,
    ("passes/solver.py", "if hi - lo <= _PROBE_LO_GAP * hi:",
     "if hi - lo < _PROBE_LO_GAP * hi:"): _PATH,
    ("passes/solver.py", "if hi - lo <= _PROBE_LO_GAP * hi:",
     "if hi - lo <= _PROBE_LO_GAP / hi:"): _PATH,
    ("passes/solver.py", "elif lo > 0 and hi > 2 * lo:", "elif lo >= 0 and hi > 2 * lo:"): _PATH,
    ("passes/solver.py", "elif lo > 0 and hi > 2 * lo:", "elif lo > 0 and hi > 3 * lo:"): _PATH,
    ("passes/solver.py", "elif lo > 0 and hi > 2 * lo:", "elif lo > 0 and hi >= 2 * lo:"): _PATH,
    ("passes/solver.py", "elif lo > 0 and hi > 2 * lo:", "elif lo > 0 or hi > 2 * lo:"): _PATH,
    ("passes/solver.py", "tau = lo + (hi - lo) / 2", "tau = lo + (hi - lo) / 3"): _PATH,
    ("passes/solver.py",
     'assert sol.bottleneck <= tau, "feasibility check returned a plan over its bound"',
     'assert sol.bottleneck <= tau, "XXfeasibility check returned a plan over its boundXX"'):
        "the text of an internal invariant no correct check violates: never shown",
    ("passes/solver.py",
     "fewer = fewest_stages(inst, hi * (1.0 + tie_tolerance) if tie_tolerance > 0 else hi)",
     "fewer = fewest_stages(inst, hi * (1.0 + tie_tolerance) if tie_tolerance >= 0 else hi)"):
        "at tie_tolerance = 0, hi (1 + 0) is hi",
    ("runtime/zerobubble.py", "Costs = Sequence[tuple[float, float, float]]  # per stage: (F, B, W) "
     "seconds of one replica", "Costs = None  # per stage: (F, B, W) seconds of one replica"):
        "a type alias used only in annotations (strings under `from __future__ import annotations`)",
    ("runtime/zerobubble.py", "heap = [(0.0, i, rk) for i, rk in enumerate(ranks) if total[rk]]",
     "heap = [(1.0, i, rk) for i, rk in enumerate(ranks) if total[rk]]"):
        "every time shifts by 1 s and only the order is returned, which compares times with each "
        "other (exact for the tests' integer and dyadic costs; only float rounding could differ)",
    ("runtime/zerobubble.py", "progress = 0", "progress = 1"): _STALL,
    **{("runtime/zerobubble.py",
        "stalled: dict[Rank, tuple[int, float]] = {rk: (-1, -1.0) for rk in ranks}",
        f"stalled: dict[Rank, tuple[int, float]] = {{rk: {v} for rk in ranks}}"): _STALL
       for v in ("(+1, -1.0)", "(-2, -1.0)", "(-1, +1.0)", "(-1, -2.0)")},
    ("passes/solver.py", "None, optimizer_state_factor, False)",
     "None, optimizer_state_factor, True)"):
        "evaluate prices the replicas it is given; `straight` only limits the replica counts a "
        "search may choose (`rs`, `cut_values`), which evaluate never reads",
    ("passes/solver.py", "hi = 1.0", "hi = 2.0"): _BRACKET,
    ("passes/solver.py", "lo = hi / 2", "lo = hi / 3"): _BRACKET,
    ("passes/solver.py", "lo, hi = hi, min(2 * hi, _NO_PLAN)", "lo, hi = hi, min(3 * hi, _NO_PLAN)"):
        _BRACKET,
    ("passes/solver.py", "mid = lo + (hi - lo) / 2", "mid = lo + (hi - lo) / 3"):
        "a third instead of a half still keeps ok(lo) false and ok(hi) true and ends only on "
        "adjacent floats (lo + (hi - lo) / 3 rounds to lo only there): the same hi",
    ("runtime/zerobubble.py",
     "return end + (wire[key[1] + 1] if key[1] + 1 < S else 0.0)",
     "return end + (wire[key[1] + 1] if key[1] + 1 < S else 1.0)"):
        "a last-stage F's output goes nowhere: this value is read only as one more wake-up time "
        "of a waiting rank, which finds the state it left (nothing completes then) and waits again",
    ("runtime/zerobubble.py",
     'return done.get(key, float("inf")) if key[1] == s else arrival(key)',
     'return done.get(key, float("XXinfXX")) if key[1] == s else arrival(key)'):
        "unreachable with key[1] == s: that is a last-stage B's own F, which ends when the rank "
        "is next free, so the B runs at once and is never pending when a W is weighed",
    ("runtime/zerobubble.py",
     'return all(arrives("B", s, k, t) >= end for k in waiting_b[rk]) and \\',
     'return all(arrives("XXBXX", s, k, t) >= end for k in waiting_b[rk]) and \\'): _NOT_F,
    ("runtime/zerobubble.py", 'b_ready = [k for k in waiting_b[rk] if ready("B", s, k, t)]',
     'b_ready = [k for k in waiting_b[rk] if ready("XXBXX", s, k, t)]'): _NOT_F,
    ("runtime/zerobubble.py", "pick: Action | None = None", "pick: Action & None = None"):
        "a local variable's annotation: never evaluated",
    ("runtime/zerobubble.py", "pushes += 1", "pushes += 2"):
        "push numbers only break ties between equal times, and still increase: the same order",
    ("runtime/zerobubble.py", "progress += 1", "progress -= 1"): _STALL,
    ("runtime/zerobubble.py", "progress += 1", "progress += 2"): _STALL,
    ("runtime/buckets.py", "Launch = Callable[[int, torch.Tensor], Any]", "Launch = None"):
        "a type alias used only in annotations (strings under `from __future__ import annotations`)",
    ("runtime/buckets.py", "used = 0", "used = 1"):
        "never read: the first parameter opens a bucket (`not buckets`) and resets it",
    ("runtime/buckets.py", "used = 0", "used = None"):
        "never read: the first parameter opens a bucket (`not buckets`) and resets it",
    **{("runtime/buckets.py", f"{name}: {t} = field(init=False, default_factory={f})",
        f"{name}: {t} = {new}"): why
       for name, t, f in (("pending", "list[Any]", "list"), ("_missing", "list[int]", "list"),
                          ("_filled", "set[str]", "set"),
                          ("_views", "dict[str, torch.Tensor]", "dict"))
       for new, why in ((f"field(init=True, default_factory={f})", _INIT),
                        ("None", _INIT if name == "_views" else _STARTED))},
    ("runtime/buckets.py", "bufs: list[torch.Tensor] = field(init=False)",
     "bufs: list[torch.Tensor] = None"): _INIT,
    ("runtime/buckets.py", "active: bool = field(init=False, default=False)",
     "active: bool = field(init=True, default=False)"): _INIT,
    ("runtime/buckets.py", "active: bool = field(init=False, default=False)",
     "active: bool = None"): "`active` is only tested for truth: None is falsy like False",
    ("runtime/buckets.py", "self.active = False", "self.active = None"):
        "`active` is only tested for truth: None is falsy like False",
    ("runtime/buckets.py",
     'assert len(self.pending) == len(self.bufs), "every bucket must be launched"',
     'assert len(self.pending) == len(self.bufs), "XXevery bucket must be launchedXX"'):
        "the text of an internal invariant no correct round violates: never shown",
    ("runtime/buckets.py", "if count > 0 and count != 1:", "if count > 1 and count != 1:"):
        "the count is a whole number of minibatches: > 0 and != 1 is > 1",
    ("runtime/buckets.py", "for b in bufs[1:]:", "for b in bufs[2:]:"): _CAT,
    ("runtime/buckets.py", "out = torch.promote_types(out, b.dtype)", "out = None"): _CAT,
    ("runtime/buckets.py", "last: int | None = None", "last: int & None = None"):
        "a local variable's annotation: never evaluated",
    ("runtime/schedule.py", "Rank = tuple[int, int]", "Rank = None"): _ALIAS,
    **{("runtime/schedule.py", 'ActionKind = Literal["F", "B", "W", "U"]', new): _ALIAS
       for new in ('ActionKind = Literal["XXFXX", "B", "W", "U"]',
                   'ActionKind = Literal["F", "XXBXX", "W", "U"]',
                   'ActionKind = Literal["F", "B", "XXWXX", "U"]',
                   'ActionKind = Literal["F", "B", "W", "XXUXX"]', "ActionKind = None")},
    ("runtime/schedule.py", "version: int | None = None", "version: int & None = None"):
        _ANNOTATION,
    ("runtime/schedule.py",
     "pos = b_pos[n_le - 1] + 1 if n_le else (b_pos[0] if b_pos else len(acts))",
     "pos = b_pos[n_le - 1] + 1 if n_le else (b_pos[1] if b_pos else len(acts))"):
        "unreachable with a backward: replica j's first minibatch j < r is in group 0 both for "
        "pipedream (groups of r) and 2bw (groups of m >= workers), so n_le >= 1 for every g",
    ("runtime/schedule.py", "for i in range(len(acts) + 1):", "for i in range(len(acts) + 2):"):
        "every insertion position is at most len(acts): index len(acts) + 1 finds nothing",
    ("runtime/schedule.py", "fwd: dict[int, int | None] = {}", "fwd: dict[int, int & None] = {}"):
        "a local variable's annotation: never evaluated",
    ("runtime/schedule.py", "zb: list[dict[Rank, list[Action]]] = []",
     "zb: list[dict[Rank, list[Action]]] = None"):
        "only tested for truth (`elif zb`), where None is falsy like [], and replaced by the "
        "zero-bubble kinds before that",
    ("runtime/schedule.py", "wins, costs, comm) for b in range(math.ceil(n / m))]",
     "wins, costs, comm) for b in range(math.ceil(n * m))]"):
        "the batches past ceil(n / m) have no minibatches and are never read (the body takes "
        "zb[b] for b < ceil(n / m)): only wasted work",
    ("passes/solver.py", "None, optimizer_state_factor, False, mode, forward, held)",
     "None, optimizer_state_factor, True, mode, forward, held)"):
        "evaluate() costs the replicas it is given; `straight` only narrows the replica counts "
        "the searches try (`inst.rs`, `cut_values`), which evaluate never reads",
    ("runtime/schedule.py", 'if a.kind == "W":  # its own B, earlier in the same list',
     'if a.kind == "XXWXX":  # its own B, earlier in the same list'):
        "a W follows its own B in its rank's list and lists run in order, so the B (and what the "
        "fallthrough asks for, F or B of the same minibatch, which that B needed) is done first",
    ("runtime/schedule.py", 'else f"{dep[0]}{dep[2]} on stage {dep[1]}" if dep else "nothing")',
     'else f"{dep[0]}{dep[2]} on stage {dep[1]}" if dep else "XXnothingXX")'):
        "unreachable: only a forward on stage 0 has no dependency, and it never waits (U is "
        "the branch before)",
    ("passes/exact_stages.py", "zero = np.zeros(n + 1, dtype=bool)",
     "zero = np.zeros(n + 2, dtype=bool)"):
        _UNREAD + " (row 0 is read at indices < n: the [:n] slice and the walk back's starts)",
    ("passes/exact_stages.py",
     "E = [[zero] * (m + 1)]  # E[s][k]: ends coverable by exactly s stages within budget k",
     "E = [[zero] * (m + 2)]  # E[s][k]: ends coverable by exactly s stages within budget k"):
        _UNREAD + " (row 0 is read at budgets k - r <= m - 1)",
    ("passes/exact_stages.py", "for s in range(1, stages + 1):",
     "for s in range(1, stages + 2):"):
        "one more row E[stages + 1] is computed and never read (the answer is E[stages][m], the "
        "walk back reads rows <= stages)",
    ("passes/exact_stages.py", "for k in range(1, m + 1):", "for k in range(1, m + 2):"):
        "each row gets an entry for budget m + 1, read only by later such entries, never by the "
        "answer E[stages][m] or the walk back (budgets <= m)",
    ("passes/exact_stages.py", "acc = row[k - 1].copy()", "acc = row[k - 2].copy()"):
        "at k = 1 row[-1] is row[0]; for k >= 2 the k-th step regains row[k - 1]: with a worker "
        "more every prefix set E[s-1][k-r] is a superset and each stage's in-flight count "
        "ceil((m - k + r) / r) no larger, so every end reached at k - 1 is reached at k",
    ("passes/exact_stages.py", "while k > 1 and E[s][k - 1][x]:",
     "while k >= 1 and E[s][k - 1][x]:"):
        "at k = 1 it reads E[s][0], which is all False for every s >= 1 (row = [np.zeros(...)]): "
        "the loop stops there either way",
    ("passes/exact_stages.py", "keep = e > starts", "keep = e >= starts"):
        "a start with e == start adds +1 and -1 at the same index of diff: nothing",
    ("passes/exact_stages.py", "keep = e > starts", "keep = None"):
        "indexing with None keeps every start (an extra axis np.add.at accepts); the starts with "
        "e == start add +1 and -1 at the same index: the same as `e > starts`",
    ("passes/exact_stages.py", "diff = np.zeros(n + 2, dtype=np.int64)",
     "diff = np.zeros(n + 3, dtype=np.int64)"): _UNREAD + " (the cumsum is sliced [: n + 1])",
    ("passes/recompute.py", "best, arg = -1, (0, False)", "best, arg = -2, (0, False)"):
        _NO_REACH,
    ("passes/recompute.py", "best, arg = -1, (0, False)", "best, arg = -1, (1, False)"):
        _NO_REACH,
    ("passes/recompute.py", "best, arg = -1, (0, False)", "best, arg = -1, (0, True)"):
        _NO_REACH,
    ("passes/recompute.py", "ok &= inst.mem_many(v, starts, ends, x) <= inst.cap",
     "ok = inst.mem_many(v, starts, ends, x) <= inst.cap"): _PREFILTER,
    ("passes/recompute.py", "ok &= inst.mem_many(v, starts, ends, x) <= inst.cap",
     "ok |= inst.mem_many(v, starts, ends, x) <= inst.cap"): _PREFILTER,
    ("passes/feasibility.py",
     "checks: int = 0                    # feasibility checks the search used (diagnostics)",
     "checks: int = 1                    # feasibility checks the search used (diagnostics)"):
        _ALL_FIELDS,
    ("passes/feasibility.py",
     "checks: int = 0                    # feasibility checks the search used (diagnostics)",
     "checks: int = None                    # feasibility checks the search used (diagnostics)"):
        _ALL_FIELDS,
    ("passes/feasibility.py",
     "recompute: tuple[bool, ...] = ()   # per stage: activation recomputation (() = none)",
     "recompute: tuple[bool, ...] = None   # per stage: activation recomputation (() = none)"):
        _ALL_FIELDS,
    ("passes/feasibility.py",
     "recompute_times: tuple[float, ...] = ()  # alpha[r] * F_s where recomputing, else 0",
     "recompute_times: tuple[float, ...] = None  # alpha[r] * F_s where recomputing, else 0"):
        _ALL_FIELDS,
    ("passes/feasibility.py", "self.alpha = [0.0] + [float(x) for x in alpha[:workers]]",
     "self.alpha = [1.0] + [float(x) for x in alpha[:workers]]"): _INDEX0,
    ("passes/feasibility.py", "self.beta = [0.0] + [float(x) for x in beta[:workers]]",
     "self.beta = [1.0] + [float(x) for x in beta[:workers]]"): _INDEX0,
    ("passes/feasibility.py",
     "self.gamma = [1.0] + [float(x) for x in gamma[:workers]]  # index 0 unused",
     "self.gamma = [2.0] + [float(x) for x in gamma[:workers]]  # index 0 unused"):
        "row 0 of cutm (r = 0) is never read: `ok[r, ...]` and `cutm[self.rs]` take r >= 1",
    ("runtime/zerobubble.py", "moved = False", "moved = None"):
        "only tested for truth (`while moved`) and set True on progress; None is falsy too",
    ("runtime/placed_orders.py",
     "heap = [(0.0, i, p) for i, p in enumerate(p for p in range(P) if left[p])]",
     "heap = [(1.0, i, p) for i, p in enumerate(p for p in range(P) if left[p])]"):
        "every time shifts by 1 s (stage 0's F, ready at 0, is ready at any t >= 1 too) and only "
        "the order is returned, which compares times with each other (exact for the tests' "
        "integer and dyadic costs; only float rounding could differ)",
    ("runtime/placed_orders.py", "pushes, progress = len(heap), 0",
     "pushes, progress = len(heap), 1"): _PROGRESS,
    ("runtime/placed_orders.py", "progress += 1", "progress -= 1"): _PROGRESS,
    ("runtime/placed_orders.py", "progress += 1", "progress += 2"): _PROGRESS,
    ("runtime/placed_orders.py", "pushes += 1", "pushes += 2"):
        "push numbers only break ties between equal times, and still increase: the same order",
    ("runtime/placed_orders.py", "pick: tuple[str, int, int] | None = None",
     "pick: tuple[str, int, int] & None = None"): "a local variable's annotation: never evaluated",
    ("runtime/placed_orders.py", "Step = tuple[Rank, Action]  # one entry of a process's merged list",
     "Step = None  # one entry of a process's merged list"): _ALIAS,
    ("runtime/placed_orders.py", "if len(wire) != S or min(wire, default=0.0) < 0:",
     "if len(wire) != S or min(wire, default=1.0) < 0:"):
        "the default is used only for an empty wire, i.e. S = 0 (len(wire) == S is checked "
        "first), and neither 0.0 nor 1.0 is < 0: the same acceptance",
    ("runtime/placed_orders.py",
     "bs = sorted((k, -s) for s in stages for k in wait_b[s] if dep_end(\"B\", s, k) <= t)",
     "bs = sorted((k, -s) for s in stages for k in wait_b[s] if dep_end(\"XXBXX\", s, k) <= t)"):
        _DEP_END_B,
    ("runtime/placed_orders.py",
     "soon = [dep_end(\"B\", q, j) for q in stages for j in wait_b[q]] + \\",
     "soon = [dep_end(\"XXBXX\", q, j) for q in stages for j in wait_b[q]] + \\"): _DEP_END_B,
    ("runtime/placement.py", "R = placed.schedule.replicas[0] if S else 1",
     "R = placed.schedule.replicas[0] if S else 2"):
        "R is read only at an update step; S = 0 only in a hand-built PlacedSchedule (placement() "
        "needs S >= P >= 1), whose schedule has no rank for a step to be on: validate_placed "
        "refuses any step there before process_order (hosted ranks must be the schedule's: none)",
    ("runtime/placement.py", "progress = False", "progress = None"):
        "only tested for truth (`while progress`) and set True on progress; None is falsy too",
    ("runtime/placement.py",
     "if a.kind == \"U\" and R > 1:  # an all-reduce: every replica's process there",
     "if a.kind == \"U\" and R >= 1:  # an all-reduce: every replica's process there"):
        "with R = 1 the all-reduce branch runs the update alone as the plain path does: its one "
        "peer where[(s, 0)] is this process, whose next step is this one, so (p, ptr[p]) is "
        "appended and ptr moves on; the plain path's extra done entry (\"U\", s, b) is never "
        "asked for (need() returns F or B keys only)",
    ("runtime/placement.py", "src, cut = (None, 0) if s == 0 else ((\"F\", s - 1, k), s)",
     "src, cut = (None, 1) if s == 0 else ((\"F\", s - 1, k), s)"):
        "cut is read only when src is not None, and stage 0's F has src None",
    ("runtime/placement.py", "elif a.kind == \"W\":", "elif a.kind == \"XXWXX\":"):
        "a W then takes its B's input time as its own: ready is at most that B's start, the B "
        "(same rank, so same process) runs before the W (process_order: W needs B) and free[p] "
        "only grows, so the W still starts at free[p]; its duration and end key read a.kind",
    ("runtime/placement.py", "src, cut = (\"B\", s, k), 0", "src, cut = (\"B\", s, k), 1"):
        _OWN_RANK,
    ("runtime/placement.py",
     "src, cut = ((\"F\", s, k), 0) if s == S - 1 else ((\"B\", s + 1, k), s + 1)",
     "src, cut = ((\"F\", s, k), 1) if s == S - 1 else ((\"B\", s + 1, k), s + 1)"):
        _OWN_RANK,
    ("runtime/placement.py", "_ = DeadlockError  # re-exported for callers catching it from here",
     "_ = None  # re-exported for callers catching it from here"):
        "`_` is a throwaway name nothing reads; DeadlockError stays bound in the module by its "
        "import from .schedule, so `from fxpipe.runtime.placement import DeadlockError` works",
    ("runtime/schedule.py", "progress = False", "progress = None"):
        "only tested for truth (`while progress`) and set True on progress; None is falsy too",
    ("passes/plan.py", "batch_size: int | None = None", "batch_size: int & None = None"): _ANNOTATION,
    ("passes/plan.py", "model_fingerprint: str | None = None",
     "model_fingerprint: str & None = None"): _ANNOTATION,
    ("passes/exact_stages.py", "while k > 1 and E[s][k - 1][x]:",
     "while k > 2 and E[s][k - 1][x]:"):
        ("only s = 1 can stop at k = 2 (E[s][1] is empty for s >= 2: s stages need s workers); its "
         "start is 0 either way and r = 1, tried first, fits there too (in flight m - 1, not m): "
         "only its flag can change, True -> False under \"auto\", where the stage fits without it "
         "at the plan's own count (<= m - 1: the later stages use <= m - 2 workers), so "
         "solve()'s _solution drops the original's True: the same plan"),
    ("passes/exact_stages.py", "found = None",
     'found = ""'):
        _WITNESS_EXISTS + " (\"\" is falsy like None for `if found`)",
    ("passes/exact_stages.py", 'assert found is not None, "exact-stage reconstruction lost its witness"',
     'assert found is not None, "XXexact-stage reconstruction lost its witnessXX"'):
        "the text of an internal invariant no walk violates: " + _WITNESS_EXISTS,
    ("passes/exact_stages.py", "x, k = found[0], k - found[1]",
     "x, k = found[0], k - found[2]"):
        ("k drops by the flag (0 or 1) instead of r >= 1, so no further: the next step's while "
         "loop still lowers it to the least budget covering the new x (E grows with k), which "
         "is <= k - r since the start came from E[s-1][k-r]; after the last step k is not read"),
    ("passes/recompute.py", "Flagged = list[tuple[int, int, bool]]  # (start, replicas, recompute) per stage",
     "Flagged = None  # (start, replicas, recompute) per stage"):
        _ALIAS,
    ("passes/recompute.py", "R = [0] * (m + 1)",
     "R = [0] * (m + 2)"):
        _UNREAD + " (R is read at budgets <= m)",
    ("passes/recompute.py", "ch: list[tuple[int, int, bool] | None] = [None] * (m + 1)",
     "ch: list[tuple[int, int, bool] & None] = [None] * (m + 1)"):
        "a local variable's annotation: never evaluated",
    ("passes/recompute.py", "ch: list[tuple[int, int, bool] | None] = [None] * (m + 1)",
     "ch: list[tuple[int, int, bool] | None] = [None] * (m + 2)"):
        _UNREAD + " (_rebuild reads budgets <= m)",
    ("passes/recompute.py", "starts = _starts(ok, r, min(R[k - r], n - 1))",
     "starts = _starts(ok, r, min(R[k - r], n + 1))"):
        ("R[k - r] < n here (the loop returns as soon as some R(k) >= n): the min is R[k - r] "
         "either way"),
    ("passes/recompute.py", "if e > best:",
     "if e >= best:"):
        _NEED,
    ("passes/recompute.py", "prev = [0] * (m + 1)",
     "prev = [0] * (m + 2)"):
        _UNREAD + " (budgets kp in `changed` and kp + r are <= m)",
    ("passes/recompute.py", 'cch: list[tuple[str, int, int, bool]] = [("s", 0, 0, False)] * (m + 1)',
     'cch: list[tuple[str, int, int, bool]] = [("XXsXX", 0, 0, False)] * (m + 1)'):
        _NO_S,
    ("passes/recompute.py", 'cch: list[tuple[str, int, int, bool]] = [("s", 0, 0, False)] * (m + 1)',
     'cch: list[tuple[str, int, int, bool]] = [("s", 1, 0, False)] * (m + 1)'):
        _NO_S,
    ("passes/recompute.py", 'cch: list[tuple[str, int, int, bool]] = [("s", 0, 0, False)] * (m + 1)',
     'cch: list[tuple[str, int, int, bool]] = [("s", 0, 1, False)] * (m + 1)'):
        _NO_S,
    ("passes/recompute.py", 'cch: list[tuple[str, int, int, bool]] = [("s", 0, 0, False)] * (m + 1)',
     'cch: list[tuple[str, int, int, bool]] = [("s", 0, 0, True)] * (m + 1)'):
        _NO_S,
    ("passes/recompute.py", 'cch: list[tuple[str, int, int, bool]] = [("s", 0, 0, False)] * (m + 1)',
     'cch: list[tuple[str, int, int, bool]] = [("s", 0, 0, False)] * (m + 2)'):
        _UNREAD + " (backtrack_layers reads budgets <= m)",
    ("passes/recompute.py", "if prev[kp] >= n:",
     "if prev[kp] > n:"):
        _PREV_BELOW_N,
    ("passes/recompute.py", "starts = _starts(ok, r, min(prev[kp], n - 1))",
     "starts = _starts(ok, r, min(prev[kp], n + 1))"):
        "prev[kp] < n here (the line above skips prev[kp] >= n): the min is prev[kp] either way",
    ("passes/recompute.py", "if e > cur[k]:",
     "if e >= cur[k]:"):
        ("_best_reach returns -1 or an end >= need = cur[k] + 1 (cur[k] >= 0): `e >= cur[k]` "
         "holds exactly when `e > cur[k]` does"),
    ("passes/recompute.py", 'cur[k], cch[k] = e, ("r", r, a, x)',
     'cur[k], cch[k] = e, ("XXrXX", r, a, x)'):
        "backtrack_layers tells entries apart only by \"k\" and \"s\": any other kind is a stage",
    ("passes/recompute.py", 'cur[k], cch[k] = cur[k - 1], ("k", 0, 0, False)',
     'cur[k], cch[k] = cur[k + 1], ("k", 0, 0, False)'):
        _NEVER_LOWER,
    ("passes/recompute.py", 'cur[k], cch[k] = cur[k - 1], ("k", 0, 0, False)',
     'cur[k], cch[k] = cur[k - 2], ("k", 0, 0, False)'):
        _NEVER_LOWER,
    ("passes/recompute.py", 'cur[k], cch[k] = cur[k - 1], ("k", 0, 0, False)',
     'cur[k], cch[k] = cur[k - 1], ("XXkXX", 0, 0, False)'):
        _NEVER_LOWER,
    ("passes/recompute.py", 'cur[k], cch[k] = cur[k - 1], ("k", 0, 0, False)',
     "cur[k], cch[k] = None"):
        _NEVER_LOWER,
    ("passes/recompute.py", 'cur[k], cch[k] = cur[k - 1], ("k", 0, 0, False)',
     'cur[k], cch[k] = cur[k - 1], ("k", 1, 0, False)'):
        _K_FIELDS,
    ("passes/recompute.py", 'cur[k], cch[k] = cur[k - 1], ("k", 0, 0, False)',
     'cur[k], cch[k] = cur[k - 1], ("k", 0, 1, False)'):
        _K_FIELDS,
    ("passes/recompute.py", 'cur[k], cch[k] = cur[k - 1], ("k", 0, 0, False)',
     'cur[k], cch[k] = cur[k - 1], ("k", 0, 0, True)'):
        _K_FIELDS,
    ("passes/feasibility.py", "self.cutm[:, n] = 0.0",
     "self.cutm[:, n] = 1.0"):
        _COLUMN_N,
    ("passes/feasibility.py", "self.cutm[:, n] = 0.0",
     "self.cutm[:, n] = None"):
        _COLUMN_N,
    # line 117
    (_F, 'lo: int = -1) -> int:',
     'lo: int = -2) -> int:'):
        _LO_DEFAULT,
    # line 124
    (_F, 'e = bisect_right(key, key[a] + lim, start) - 1',
     'e = bisect_right(key, key[a] - lim, start) - 1'):
        _GUESS,
    # line 124
    (_F, 'e = bisect_right(key, key[a] + lim, start) - 1',
     'e = bisect_right(key, key[a] + lim, start) + 1'):
        _GUESS,
    # line 124
    (_F, 'e = bisect_right(key, key[a] + lim, start) - 1',
     'e = bisect_right(key, key[a] + lim, start) - 2'):
        _GUESS,
    # line 126
    (_F, 'steps = 0',
     'steps = 1'):
        _GUESS,
    # line 129
    (_F, 'steps += 1',
     'steps = 1'):
        _GUESS,
    # line 129
    (_F, 'steps += 1',
     'steps -= 1'):
        _GUESS,
    # line 129
    (_F, 'steps += 1',
     'steps += 2'):
        _GUESS,
    # line 130
    (_F, 'if steps > 8:  # long flat run at the boundary: exact binary search instead',
     'if steps >= 8:  # long flat run at the boundary: exact binary search instead'):
        _GUESS,
    # line 130
    (_F, 'if steps > 8:  # long flat run at the boundary: exact binary search instead',
     'if steps > 9:  # long flat run at the boundary: exact binary search instead'):
        _GUESS,
    # line 136
    (_F, 'while e > start and not f(e):',
     'while e >= start and not f(e):'):
        _START_TRUE,
    # line 140
    (_F, 'def reach(self, r: int, v: int, a: int, tau: float, lo: int = -1) -> tuple[int, int]:',
     'def reach(self, r: int, v: int, a: int, tau: float, lo: int = -2) -> tuple[int, int]:'):
        _LO_DEFAULT,
    # line 143
    (_F, 'tk = self._tkey.get(r)',
     'tk = None'):
        _CACHE,
    # line 145: a search key
    **{(_F, 'tk = self._tkey[r] = (self.alpha[r] * self.Cc + self.beta[r] * self.Pc).tolist()',
       'tk = self._tkey[r] = ' + new): _GUESS
       for new in (
                 '(self.alpha[r] / self.Cc + self.beta[r] * self.Pc).tolist()',
                 '(self.alpha[r] * self.Cc - self.beta[r] * self.Pc).tolist()',
                 '(self.alpha[r] * self.Cc + self.beta[r] / self.Pc).tolist()')},
    # line 149
    (_F, 'if self.mem(v, a, et) <= self.cap:',
     'if self.mem(v, a, et) < self.cap:'):
        _MEM_AT_CAP,
    # line 151
    (_F, 'mk = self._mkey.get(v)',
     'mk = None'):
        _CACHE,
    # line 153: a search key
    **{(_F, 'mk = self._mkey[v] = ((2.0 + self.opt + v - 1) * self.Pc + v * self.Ac).tolist()',
       'mk = self._mkey[v] = ' + new): _GUESS
       for new in (
                 '((3.0 + self.opt + v - 1) * self.Pc + v * self.Ac).tolist()',
                 '((2.0 - self.opt + v - 1) * self.Pc + v * self.Ac).tolist()',
                 '((2.0 + self.opt - v - 1) * self.Pc + v * self.Ac).tolist()',
                 '((2.0 + self.opt + v + 1) * self.Pc + v * self.Ac).tolist()',
                 '((2.0 + self.opt + v - 2) * self.Pc + v * self.Ac).tolist()',
                 '((2.0 + self.opt + v - 1) / self.Pc + v * self.Ac).tolist()',
                 '((2.0 + self.opt + v - 1) * self.Pc - v * self.Ac).tolist()',
                 '((2.0 + self.opt + v - 1) * self.Pc + v / self.Ac).tolist()')},
    # line 247
    (_F, 'if x >= inst.n or x <= 0:',
     'if x >= inst.n or x < 0:'):
        _X0,
    # line 249
    (_F, 'row = self.rows.get(r)',
     'row = None'):
        _LA_PATH,
    # line 254
    (_F, 'for _ in range(16):',
     'for _ in range(17):'):
        _LA_PATH,
    # line 255
    (_F, 'if p <= 0:',
     'if p < 0:'):
        _P0,
    # line 260
    (_F, 'if c < rejected:',
     'if c <= rejected:'):
        _TIE,
    # line 276
    (_F, 'Stages = list[tuple[int, int]]  # (start, replicas) per stage',
     'Stages = None  # (start, replicas) per stage'):
        _ALIAS,
    # line 290
    (_F, 'R = [0] * (m + 1)',
     'R = [0] * (m + 2)'):
        _UNREAD + " (R is read at budgets <= m)",
    # line 291
    (_F, 'ch: list[tuple[int, int] | None] = [None] * (m + 1)',
     'ch: list[tuple[int, int] & None] = [None] * (m + 1)'):
        "a local variable's annotation: never evaluated",
    # line 291
    (_F, 'ch: list[tuple[int, int] | None] = [None] * (m + 1)',
     'ch: list[tuple[int, int] | None] = [None] * (m + 2)'):
        _UNREAD + " (_rebuild_budget reads budgets <= m)",
    # line 299
    (_F, 'if rejected < nxt:',
     'if rejected <= nxt:'):
        _TIE,
    # line 308
    (_F, 'e, _ = inst.reach(r, v, a, tau, best + 1)',
     'e, _ = inst.reach(r, v, a, tau, best - 1)'):
        _HINT,
    # line 309
    (_F, 'if e > best:',
     'if e >= best:'):
        _NEED_REACH,
    # line 318
    (_F, 'if t < nxt and (cap is None or inst.mem(_v(m, k, r), a, best + 1) <= cap):',
     'if t <= nxt and (cap is None or inst.mem(_v(m, k, r), a, best + 1) <= cap):'):
        _TIE,
    # line 348
    (_F, 'prev = [0] * (m + 1)',
     'prev = [0] * (m + 2)'):
        _UNREAD + " (budgets kp in `changed` and kp + r are <= m)",
    # line 353
    (_F, 'cch: list[tuple[str, int, int]] = [("s", 0, 0)] * (m + 1)',
     'cch: list[tuple[str, int, int]] = [("XXsXX", 0, 0)] * (m + 1)'):
        _NO_S,
    # line 353
    (_F, 'cch: list[tuple[str, int, int]] = [("s", 0, 0)] * (m + 1)',
     'cch: list[tuple[str, int, int]] = [("s", 1, 0)] * (m + 1)'):
        _NO_S,
    # line 353
    (_F, 'cch: list[tuple[str, int, int]] = [("s", 0, 0)] * (m + 1)',
     'cch: list[tuple[str, int, int]] = [("s", 0, 1)] * (m + 1)'):
        _NO_S,
    # line 353
    (_F, 'cch: list[tuple[str, int, int]] = [("s", 0, 0)] * (m + 1)',
     'cch: list[tuple[str, int, int]] = [("s", 0, 0)] * (m + 2)'):
        _UNREAD + " (backtrack_layers reads budgets <= m)",
    # line 355
    (_F, 'if prev[kp] >= n:',
     'if prev[kp] > n:'):
        _PREV_BELOW_N,
    # line 368
    (_F, 'e = inst.reach(r, v, a, tau, best + 1)[0]',
     'e = inst.reach(r, v, a, tau, best - 1)[0]'):
        _HINT,
    # line 370
    (_F, 'cand[k], cch[k] = e, ("r", r, a)',
     'cand[k], cch[k] = e, ("XXrXX", r, a)'):
        _ANY_KIND,
    # line 372
    (_F, 'for k in range(1, m + 1):  # R_s(k) >= R_s(k-1): a bigger budget may leave workers idle',
     'for k in range(2, m + 1):  # R_s(k) >= R_s(k-1): a bigger budget may leave workers idle'):
        "cur[0] is 0 in every layer (only budgets kp + r >= 1 are set): k = 1 never takes cur[0]",
    # line 372
    (_F, 'for k in range(1, m + 1):  # R_s(k) >= R_s(k-1): a bigger budget may leave workers idle',
     'for k in range(1, m - 1):  # R_s(k) >= R_s(k-1): a bigger budget may leave workers idle'):
        "the body it would skip " + _NEVER_LOWER_FS,
    # line 374
    (_F, 'cur[k], cch[k] = cur[k - 1], ("k", 0, 0)',
     'cur[k], cch[k] = cur[k + 1], ("k", 0, 0)'):
        _NEVER_LOWER_FS,
    # line 374
    (_F, 'cur[k], cch[k] = cur[k - 1], ("k", 0, 0)',
     'cur[k], cch[k] = cur[k - 2], ("k", 0, 0)'):
        _NEVER_LOWER_FS,
    # line 374
    (_F, 'cur[k], cch[k] = cur[k - 1], ("k", 0, 0)',
     'cur[k], cch[k] = cur[k - 1], ("XXkXX", 0, 0)'):
        _NEVER_LOWER_FS,
    # line 374
    (_F, 'cur[k], cch[k] = cur[k - 1], ("k", 0, 0)',
     'cur[k], cch[k] = cur[k - 1], ("k", 1, 0)'):
        _NEVER_LOWER_FS,
    # line 374
    (_F, 'cur[k], cch[k] = cur[k - 1], ("k", 0, 0)',
     'cur[k], cch[k] = cur[k - 1], ("k", 0, 1)'):
        _NEVER_LOWER_FS,
    # line 374
    (_F, 'cur[k], cch[k] = cur[k - 1], ("k", 0, 0)',
     'cur[k], cch[k] = None'):
        _NEVER_LOWER_FS,
    # line 395
    (_F, 'if kind == "k":',
     'if kind == "XXkXX":'):
        _NO_K,
    # line 397
    (_F, 'elif kind == "s":',
     'elif kind == "XXsXX":'):
        _NO_S,
}


# Survivors of the last saved run that a test added afterwards kills, checked by applying the
# mutant by hand (not yet rerun through this driver): (module, line, mutated line) -> the test.
# Empty once a rerun (--reuse or --survivors) has recorded those kills itself.
KILLED_SINCE: dict[tuple[str, str, str], str] = {}


# Arguments for a line whose text repeats in the module with another meaning (a bare `break`),
# keyed by line number too: (module, line number, stripped line, mutated line) -> why. A line
# number moves with any edit above it, so after a rerun such an argument must be re-checked
# (the report then shows the survivor as unargued).
_ASCENDING = "inst.rs is ascending: once r > k every later r is too, and `continue` skips them all"
EQUIVALENT_AT: dict[tuple[str, int, str, str], str] = {
    ("passes/exact_stages.py", 33, "break", "continue"): _ASCENDING,
    ("passes/exact_stages.py", 60, "break", "continue"): _ASCENDING,
    ("passes/recompute.py", 82, "break", "continue"): _ASCENDING,
    ("passes/recompute.py", 94, "break", "continue"): _ASCENDING,
    ("passes/recompute.py", 134, "break", "continue"):
        "inst.rs is ascending: once kp + r > m every later r's budget is too, and `continue` "
        "skips them all",
    ("passes/recompute.py", 130, "continue", "break"):
        "unreachable: the `if` above is " + _PREV_BELOW_N,
    # line 78 has the same text in check_budget_rc
    ("passes/recompute.py", 141, "for k in range(1, m + 1):", "for k in range(2, m + 1):"):
        "cur[0] is 0 in every layer (only budgets kp + r >= 1 are set): k = 1 never takes cur[0]",
    ("passes/recompute.py", 141, "for k in range(1, m + 1):", "for k in range(1, m - 1):"):
        "the body it would skip " + _NEVER_LOWER,
    # feasibility.py: keyed by the saved run's line number and by the line's number now (3 lines
    # up since _Inst.fits was dropped; neither number holds another line of the same text)
    **{(_F, ln, o, n): why for lns, o, n, why in (
        ((297, 294), "break", "continue", _ASCENDING),
        ((356, 353), "continue", "break", "unreachable: the `if` above is " + _PREV_BELOW_N),
        ((360, 357), "break", "continue", _KP_ASCENDING),
        ((396, 393), "k -= 1", "k = 1", _NO_K), ((396, 393), "k -= 1", "k += 1", _NO_K),
        ((396, 393), "k -= 1", "k -= 2", _NO_K),
        ((398, 395), "si -= 1", "si = 1", _NO_S), ((398, 395), "si -= 1", "si += 1", _NO_S),
        ((398, 395), "si -= 1", "si -= 2", _NO_S),
        ((400, 397), "if a < x:", "if a <= x:", _SKIP_NONE)) for ln in lns},
    # line 133, _search's bisection (reach_many's, line 181, has the same text)
    (_F, 133, "mid = (lo + hi + 1) // 2", "mid = (lo + hi + 2) // 2"): _MID,
}
