"""How many dead actors of one role (the inference servers; the env actors of one environment) the driver replaces
before it stops the run: replacing rides out a lost node, but an actor that dies again and again is a bug or a
broken machine, and replacing it forever would hide that."""

from __future__ import annotations


class RestartLimitExceeded(RuntimeError):
    """An actor died after its role had used up `orchestrator.max_restarts_per_role`."""


class RestartBudget:
    """Counts the replacements of one role's actors in this driver process; the one past the limit raises."""

    def __init__(self, role: str, limit: int):
        self.role = role
        self.limit = limit
        self.spent = 0

    def spend(self, what: str) -> None:
        """Account for replacing `what`, or raise `RestartLimitExceeded` when the role has none left."""
        if self.spent >= self.limit:
            raise RestartLimitExceeded(
                f"{what} died, and the {self.role} were already replaced {self.spent} times by this driver "
                f"(orchestrator.max_restarts_per_role={self.limit}); stopping rather than replacing it again. Look "
                "for the cause in its log above; rerunning the command resumes from the latest checkpoint."
            )
        self.spent += 1
