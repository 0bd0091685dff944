"""Settings for the hypothesis state machines, scaled up by HYPOTHESIS_PROFILE=explore."""

import os

from hypothesis import settings

# The state machines pin their example counts to keep `make test` fast; exploring multiplies them.
SCALE = 20 if os.environ.get("HYPOTHESIS_PROFILE") == "explore" else 1


def machine_settings(max_examples: int, steps: int) -> settings:
    return settings(max_examples=max_examples * SCALE, stateful_step_count=steps)
