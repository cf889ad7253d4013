"""The one exception type for mistakes a user can make (bad config, missing backend, bad file)."""


class ConfigError(Exception):
    """A user-fixable problem. The message names the setting and the fix, in one line."""

    def __init__(self, setting: str, problem: str, fix: str | None = None):
        self.setting = setting
        self.problem = problem
        self.fix = fix
        msg = f"{setting}: {problem}"
        if fix:
            msg += f" — {fix}"
        super().__init__(msg)
