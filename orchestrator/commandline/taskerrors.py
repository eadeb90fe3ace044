"""How a task ends on a user's mistake (a UserError): one `error:` line on stderr and its exit code
(1; 2 when refused before anything started), never a traceback. Fabric's own -H, -i and -S, which
would choose hosts, keys and an ssh_config for Fabric's connections, are refused the same way:
fabtrain takes all three from the inventory. fabfile.py puts @user_errors on every task.
"""

from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING, Any

from fabric import Connection
from invoke import Exit

from orchestrator.core import hostile
from orchestrator.core.errors import UserError

if TYPE_CHECKING:
    from collections.abc import Callable


def fabric_core_flags(c: Any) -> None:
    """Fabric's -H, -i and -S choose hosts, keys and an ssh_config for Fabric's own connections;
    fabtrain takes all three from the inventory, so they stop with a clear error, never ignored."""
    if isinstance(c, Connection):
        raise UserError(
            f"-H/--hosts ({c.host}) is Fabric's host list; fabtrain's hosts come from the inventory "
            "(--inventory PATH). Leave -H out",
            exit_code=2,
        )
    if c.config.connect_kwargs.get("key_filename"):
        raise UserError(
            "-i/--identity is Fabric's key option; fabtrain takes keys from the inventory (ssh: key:, "
            "or per host) or your ssh-agent and ~/.ssh/config. Leave -i out",
            exit_code=2,
        )
    if getattr(c.config, "_runtime_ssh_path", None):
        raise UserError(
            "-S/--ssh-config is Fabric's option; fabtrain reads ~/.ssh/config, or the file named by the "
            "inventory's ssh: config: field. Leave -S out",
            exit_code=2,
        )


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Print a user's mistake as one clear message and exit non-zero, never as a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            fabric_core_flags(args[0])
            return fn(*args, **kwargs)
        except UserError as exc:
            print(f"error: {hostile.text(str(exc))}", file=sys.stderr)
            raise Exit(code=exc.exit_code) from None

    return wrapper
