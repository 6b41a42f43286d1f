"""Strategy names: ``train_precision/rollout_precision[+corrector]``, e.g. ``bf16/fp8+ais``.

The name is the unit the study runs, plots and tabulates. ``+none`` is dropped (``bf16/fp8+none``
reads as ``bf16/fp8``), so each strategy has one spelling. The default sets live in
`jetrl_trainer._choices` (``STUDY_STRATEGIES``, ``STUDY_STRATEGIES_NVFP4``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from jetrl_trainer._choices import PRECISIONS, check_choice

__all__ = ["Strategy", "parse_strategies", "parse_strategy"]


@dataclass(frozen=True)
class Strategy:
    """One cell of the study: the two precisions and the corrector that a `JetGRPOConfig` gets."""

    train_precision: str
    rollout_precision: str
    corrector: str = "none"

    @property
    def name(self) -> str:
        base = f"{self.train_precision}/{self.rollout_precision}"
        return base if self.corrector == "none" else f"{base}+{self.corrector}"

    @property
    def slug(self) -> str:
        """The name as a folder name: ``bf16/fp8+ais`` -> ``bf16-fp8-ais``."""
        return self.name.replace("/", "-").replace("+", "-")

    def config_kwargs(self) -> dict[str, str]:
        """The `JetGRPOConfig` fields this strategy sets."""
        return dict(train_precision=self.train_precision, rollout_precision=self.rollout_precision,
                    corrector=self.corrector)  # fmt: skip

    def __str__(self) -> str:
        return self.name


def parse_strategy(name: str | Strategy) -> Strategy:
    """``"bf16/fp8+tis"`` -> ``Strategy("bf16", "fp8", "tis")``; case and spaces are ignored.

    The precisions must be in ``PRECISIONS``; the corrector must be registered
    (`jetrl_trainer.correctors.available_correctors`, which includes your own).
    """
    if isinstance(name, Strategy):
        return name
    if not isinstance(name, str):
        raise ValueError(f"a strategy is a string like 'bf16/fp8+ais'; got {name!r}")
    text = name.strip().lower().replace(" ", "")
    pair, plus, corrector = text.partition("+")
    train, slash, rollout = pair.partition("/")
    if not slash or not train or not rollout or (plus and not corrector):
        raise ValueError(
            f"strategy {name!r} must read 'train_precision/rollout_precision[+corrector]', e.g. 'bf16/fp8+ais' "
            "or 'fp8/fp8'."
        )
    train = check_choice(f"train precision of strategy {name!r}", train, PRECISIONS)
    rollout = check_choice(f"rollout precision of strategy {name!r}", rollout, PRECISIONS)
    return Strategy(train, rollout, _check_corrector(name, corrector or "none"))


def _check_corrector(name: str, corrector: str) -> str:
    from jetrl_trainer.correctors import available_correctors  # torch only; the registry may grow

    return check_choice(f"corrector of strategy {name!r}", corrector, available_correctors())


def parse_strategies(names: str | Iterable[str | Strategy]) -> tuple[Strategy, ...]:
    """A comma-separated string or a sequence of names; duplicates (after normalising) are refused."""
    items = [n for n in names.split(",") if n.strip()] if isinstance(names, str) else list(names)
    if not items:
        raise ValueError("no strategies given; name at least one, e.g. 'bf16/bf16,bf16/fp8'.")
    strategies = tuple(parse_strategy(n) for n in items)
    seen: set[Strategy] = set()
    for s in strategies:
        if s in seen:
            raise ValueError(f"strategy {s.name!r} is listed twice; list each strategy once.")
        seen.add(s)
    return strategies
