"""The restart bound per role: replacements up to `orchestrator.max_restarts_per_role` go through, the next one
stops the run with an error that names the role, the limit and the way back."""

import pytest

from marin_rl.config import parse_config
from marin_rl.orchestrator.restarts import RestartBudget, RestartLimitExceeded


def test_the_replacement_past_the_limit_raises_and_names_role_limit_and_resume():
    budget = RestartBudget("env actors of addition", 2)
    budget.spend("env actor addition/0")
    budget.spend("env actor addition/1")
    assert budget.spent == 2
    with pytest.raises(RestartLimitExceeded) as e:
        budget.spend("env actor addition/0")
    message = str(e.value)
    assert "env actor addition/0 died" in message and "env actors of addition were already replaced 2 times" in message
    assert "orchestrator.max_restarts_per_role=2" in message and "resumes from the latest checkpoint" in message
    assert budget.spent == 2


def test_zero_means_a_dead_actor_ends_the_run_and_negative_is_refused():
    with pytest.raises(RestartLimitExceeded):
        RestartBudget("inference servers", 0).spend("inference server 0")
    with pytest.raises(SystemExit, match="orchestrator.max_restarts_per_role must be >= 0"):
        parse_config(["--config", "experiments/quickstart.yaml", "--orchestrator.max_restarts_per_role", "-1"])
