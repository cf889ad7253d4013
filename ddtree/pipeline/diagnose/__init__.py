"""`python -m ddtree.diagnose <job dir | sweep dir>`: why tau is what it is, from the per-round records every
DFlash and DDTree job keeps (ddtree.engine.diagnostics).

Writes diagnosis.md, diagnosis.json and PNG plots into the directory (or --out):

* the drafter by depth: conditional acceptance of its top-1 (on its own top-1 chain) and the target's token's
  coverage by its top k;
* its top-1 accuracy on its main chain against off it (after the path took a non-top-1 token above), with counts and
  95 % Wilson intervals, per depth and depth-matched;
* predicted tau against the node budget (1 = a chain … 1024), the measured tau of every job drawn beside it;
* with a verification-cost curve (the jobs' own stage timings, or --cost TABLE), predicted speedup against budget and
  the best budget;
* one verdict line naming the limiting factor.

The prediction for DDTree trees (`replay_taus`) replays each recorded round: a DFlash drafter's per-position rows do
not depend on the path, so the best-first tree of any budget B is the set of rank paths whose summed drafter cost (minus
log-probability) is among the B smallest, computed from the round's recorded rows. Where the target's path is known
(its tokens up to one past the accepted depth), the depth that tree accepts is exact: recorded outright up to the
budget that ran (each accepted node's place in the best-first order), from a sketch of the rows past it. Below the
known path the rank model decides: at depth d the target's token has rank r in the drafter's row with probability
p_d(r | state), state = whether the path above stayed on the drafter's top-1 chain, independently across depths, while
which ranks the tree holds still comes from that round's rows. A chain's prediction, 1 + sum_d prod_{i<=d} p_i(0), is
the same replay for the top-1 chain (the measured tau of its own rounds, by construction). `predict_taus` is the rank
model alone: one tree shape for every round, the B most likely rank paths by measured acceptance (what a tree ordered
by acceptance rather than by the drafter's scores would reach), and the prediction for records without rows (format 1).

The package, one job a module: `records` (the inputs), `stats` (the statistics of the records), `model` (the replay, and
the rank model from its home, ddtree.engine.rank_model), `cost` (verification cost), `analysis` (the diagnosis and its verdict), `text` (markdown), `plots`,
`outputs` (the files), `cli`.
"""

from ddtree.pipeline.diagnose.analysis import diagnose, predicted_curves
from ddtree.pipeline.diagnose.cli import main
from ddtree.pipeline.diagnose.cost import read_cost_table
from ddtree.pipeline.diagnose.outputs import report_diagnoses, write_diagnosis
from ddtree.pipeline.diagnose.records import JobData, load_jobs
from ddtree.pipeline.diagnose.stats import collect

__all__ = ["JobData", "collect", "diagnose", "load_jobs", "main", "predicted_curves", "read_cost_table",
           "report_diagnoses", "write_diagnosis"]
