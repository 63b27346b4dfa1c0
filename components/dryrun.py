"""What a dry run prints hides the app's secret, on every llamarl scheduler.

``torchx run --dryrun`` prints the AppDef (``pformat`` of its dataclass) and the scheduler's
request (``str`` of the ``AppDryRunInfo``). A secret given as ``--env LLAMARL_SECRET=<hex>``
is in both: in the roles' env, and in the request the roles start from (the local
processes' env, the pods' env; the SLURM request moves it to a private file already). The
request must keep it, or the roles of a real run could not read it; so ``hide_secret``
swaps each role's env for a copy with the value hidden (the request keeps the dict it was
built from) and makes the request print with the value hidden.
"""

from typing import Any, Callable, Optional

from torchx.specs import AppDef, AppDryRunInfo

SECRET_ENV = "LLAMARL_SECRET"  # llamarl.app.control.frames.SECRET_ENV; components import nothing from app
HIDDEN = "<hidden: the app's secret>"


def hide_secret(app: AppDef, info: AppDryRunInfo[Any]) -> AppDryRunInfo[Any]:
    """``info`` whose printed form, and ``app`` whose roles' env, hide every secret value the
    roles carry in ``$LLAMARL_SECRET``. Call it after the request is built."""
    secrets = {role.env[SECRET_ENV] for role in app.roles if role.env.get(SECRET_ENV)}
    if not secrets:
        return info
    for role in app.roles:
        if SECRET_ENV in role.env:
            role.env = {**role.env, SECRET_ENV: HIDDEN}
    fmt: Optional[Callable[[Any], str]] = info._fmt
    shown = fmt or repr

    def hidden(request: Any) -> str:
        text = shown(request)
        for secret in secrets:
            text = text.replace(secret, HIDDEN)
        return text

    info._fmt = hidden
    return info
