"""How big a token tree to verify next: LLMCad's reasoning (§3.3) on measured costs and acceptance.

A decode step reads every weight once whatever its row count, so verifying c rows costs little more
than one until the step turns compute-bound; a tree pays when the expected accepted tokens per step
grow faster than its measured cost. The controller keeps a running acceptance rate α (accepted draft
tokens per tried depth) and the measured time of each chunk size, and picks the depth that maximises
expected tokens per second: (1 + α + … + α^d) / (verify(c) + d·draft). When even depth 1 does not pay it
falls back to plain decoding, probing again after `probe_every` steps so α can recover; each probe that
fails doubles the wait (up to `probe_max`), one that is accepted resets it: on open chat, where drafts
are almost never right, a probe every 16 steps cost ~4% of the decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetero.decode.step import TREE_SIZES


@dataclass(slots=True)
class TreeController:
    max_depth: int = 7
    sizes: tuple[int, ...] = TREE_SIZES
    alpha: float = 0.6  # prior acceptance per depth, until a draft has been tried
    alphas: dict[int | None, float] = field(default_factory=dict)  # drafter's confidence → EMA acceptance
    alpha_all: float | None = None  # EMA acceptance over every class: the prior of a class not tried yet
    decay: float = 0.8  # EMA weight of the past
    probe_every: int = 16
    probe_max: int = 128
    step_ms: dict[int, float] = field(default_factory=dict)  # chunk size → EMA verify time
    draft_ms: float = 0.0  # EMA time of drafting one token (0 for lookup)
    _since_probe: int = 0
    _wait: int = 0  # steps until the next probe (0: probe_every)
    _probing: bool = False  # the last choice was a probe

    def cost(self, c: int) -> float:
        """Verify time of a c-row chunk: the least measured time of any size >= c (more rows never cost less;
        a measurement above a bigger size's is noise, and a size never chosen again would keep it)."""
        known = [ms for size, ms in self.step_ms.items() if size >= c]
        if known:
            return min(known)
        base = self.step_ms.get(1, 1.0)
        return base * c  # pessimistic prior until measured: compute-bound

    def choose(self, budget: int, confidence: int | None = None, depth: int | None = None) -> tuple[int, int]:
        """(depth, size): levels to draft below the root and the tree's node budget; `confidence`: the
        drafter's class of this draft (lookup: the matched length), each with its own acceptance rate;
        `depth`: how deep the draft at hand goes (a drafted tree: verifying rows below it cannot pay). A class
        not tried yet starts from the acceptance seen over all classes (on open chat a new class at the
        0.6 prior verified a depth-1 lookup draft as an 8-row chunk)."""
        prior = self.alpha if self.alpha_all is None else self.alpha_all
        alpha = self.alphas.get(confidence, prior)
        if budget <= 1:
            return 0, 1
        best, best_rate = (0, 1), 1.0 / self.cost(1)
        cap = self.max_depth if depth is None else min(self.max_depth, depth)
        for d in range(1, min(cap, budget - 1) + 1):
            size = next((c for c in self.sizes if c >= d + 1), self.sizes[-1])
            expect = sum(alpha**i for i in range(d + 1))
            rate = expect / (self.cost(size) + d * self.draft_ms)
            if rate > best_rate:
                best, best_rate = (d, size), rate
        self._probing = False
        if best[0] == 0:
            self._since_probe += 1
            if self._since_probe >= (self._wait or self.probe_every):  # LLMCad's fallback, and a way back out of it
                self._since_probe, self._probing = 0, True
                d = min(2, cap)
                return d, next((c for c in self.sizes if c >= d + 1), self.sizes[-1])
        return best

    def observe(self, size: int, ms: float, tried: int, accepted: int, draft_ms: float, drafted: int,
                confidence: int | None = None) -> None:
        old = self.step_ms.get(size)
        self.step_ms[size] = ms if old is None else self.decay * old + (1 - self.decay) * ms
        if self._probing:  # a failed probe doubles the wait for the next, an accepted one resets it
            self._wait = self.probe_every if accepted else min(2 * (self._wait or self.probe_every), self.probe_max)
            self._probing = False
        if tried:
            rate = accepted / tried
            prior = self.alpha if self.alpha_all is None else self.alpha_all
            old_alpha = self.alphas.get(confidence, prior)
            self.alphas[confidence] = self.decay * old_alpha + (1 - self.decay) * rate
            self.alpha_all = self.decay * prior + (1 - self.decay) * rate
        if drafted:
            per = draft_ms / drafted
            self.draft_ms = per if self.draft_ms == 0 else self.decay * self.draft_ms + (1 - self.decay) * per
