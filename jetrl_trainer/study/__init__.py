"""The strategy study: the papers' comparison (BF16 vs FP8 rollouts, unified flow, correctors) in one call.

```python
from jetrl_trainer.study import StudySpec, TinyModel, run_study

spec = StudySpec(task="countdown", steps=30, seeds=(0, 1, 2))      # every strategy by default
out = run_study(spec, TinyModel("qwen3", warm_start_steps=60), "runs/study")
print(out.table.read_text())                                         # study.md; study.png beside it
```

A strategy is ``train_precision/rollout_precision[+corrector][@exact|@plain]`` (`parse_strategy`); the
default set is `STUDY_STRATEGIES`, `STUDY_STRATEGIES_NVFP4` adds the emulated NVFP4 pair, and
`GPU_STUDY_STRATEGIES` is the GPU study's (exactness pinned on or off). Every
strategy of a seed starts from the same (warm-started) weights and sees the same prompts in the same
order. Each run writes ``<output_dir>/<strategy>/seed<k>/metrics.jsonl`` (every logged metric plus
the step time split into rollout and training) and ``result.json`` (held-out evaluation, the
settings); a second call skips runs already finished. ``examples/compare_strategies.py`` is the CLI.

Departs from the papers' protocol in scale only: the same metrics, on whatever model and task you
give it (docs/study.md reports tiny-model CPU runs).
"""

from jetrl_trainer._choices import GPU_STUDY_STRATEGIES, STUDY_STRATEGIES, STUDY_STRATEGIES_NVFP4, TINY_ARCHS

from .models import ModelBuilder, PretrainedModel, TinyModel
from .runner import StudyOutputs, run_study
from .spec import StudySpec
from .strategy import Strategy, parse_strategies, parse_strategy
from .summary import Run, StrategyRow, load_runs, summarize

__all__ = [
    "GPU_STUDY_STRATEGIES",
    "STUDY_STRATEGIES",
    "STUDY_STRATEGIES_NVFP4",
    "TINY_ARCHS",
    "ModelBuilder",
    "PretrainedModel",
    "Run",
    "Strategy",
    "StrategyRow",
    "StudyOutputs",
    "StudySpec",
    "TinyModel",
    "load_runs",
    "parse_strategies",
    "parse_strategy",
    "run_study",
    "summarize",
]
