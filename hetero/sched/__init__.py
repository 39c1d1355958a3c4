"""Out-of-order subgraph scheduling of chunked prefill (mllm-NPU §3.4).

A subgraph G[i][j] is ready when its Eq. 2-3 predecessors are done; a lane (NPU, CPU, GPU) runs one
subgraph at a time (Eq. 4); a policy picks which ready subgraph an idle lane runs next (Eq. 6 or ours).
`dag` builds and compiles the graph, `policy` chooses, `simulate` replays it on a `Profile`, `executor`
runs it on real lanes, `timeline` draws it.
"""

from hetero.sched.costs import CompiledDag, build_dag, compile_dag, compiled_prefill_dag
from hetero.sched.policy import DEFAULT_POLICY, POLICIES
from hetero.sched.profile import Profile, load_profile, save_profile
from hetero.schedule import Schedule
from hetero.sched.simulate import simulate

__all__ = [
    "CompiledDag", "DEFAULT_POLICY", "POLICIES", "Profile", "Schedule", "build_dag", "compile_dag",
    "compiled_prefill_dag", "load_profile", "save_profile", "simulate",
]
