"""``kubernetes_llamarl``: torchx 0.7.0's ``kubernetes`` scheduler, plus the app's secret from a
Kubernetes Secret mounted into every pod, and the pod's IP for the control store to
listen on.

torchx names trainer replica 0's host ``localhost`` to that replica itself (the others
get the pod's DNS name): a store bound there would be reachable from no other pod. Every
pod gets ``$LLAMARL_STORE_BIND`` (``llamarl.components.llamarl.STORE_BIND_ENV``) from the
downward API, its own IP, which the component's trainer command prefers.

torchx's role mounts are host paths, volumes (PVCs) and devices only; a Secret is what
Kubernetes has for a value its users must not read in the job spec. With the component's
``--k8s_secret NAME``, every role carries the name in its metadata
(``llamarl.components.llamarl.K8S_SECRET_METADATA``) and reads ``$LLAMARL_SECRET_FILE`` under
``K8S_SECRET_DIR``; this scheduler adds the Secret as a read-only volume (files of mode
400) at that directory of every pod. The job spec then holds the Secret's name only.

Create the Secret once per namespace (the value is hex, like ``llamarl.app.control.frames.new_secret``)::

    kubectl create secret generic llamarl-run \\
        --from-literal=secret=$(python -c "import secrets; print(secrets.token_hex(32))")
"""

from typing import Any, Optional

from torchx.schedulers.api import AppDryRunInfo
from torchx.schedulers.kubernetes_scheduler import KubernetesJob, KubernetesOpts, KubernetesScheduler
from torchx.specs import AppDef

from llamarl.components.dryrun import hide_secret
from llamarl.components.llamarl import K8S_SECRET_DIR, K8S_SECRET_METADATA, STORE_BIND_ENV

SECRET_VOLUME = "llamarl-secret"


class LlamarlKubernetesScheduler(KubernetesScheduler):
    """torchx 0.7.0's KubernetesScheduler that mounts the app's Secret (module docstring)."""

    def _submit_dryrun(self, app: AppDef, cfg: KubernetesOpts) -> AppDryRunInfo[KubernetesJob]:
        info = super()._submit_dryrun(app, cfg)
        for task in info.request.resource["spec"]["tasks"]:
            pass_pod_ip(task["template"])
        names = {role.metadata.get(K8S_SECRET_METADATA) for role in app.roles} - {None}
        if len(names) > 1:
            raise ValueError(f"the roles of one app name different Kubernetes secrets: {sorted(names)}")
        if names:
            (secret_name,) = names
            for task in info.request.resource["spec"]["tasks"]:
                mount_secret(task["template"], secret_name)
        return hide_secret(app, info)


def mount_secret(pod: Any, secret_name: str) -> None:
    """Add Secret ``secret_name`` to ``pod`` (a ``V1Pod``) as a read-only volume at
    ``K8S_SECRET_DIR`` of each of its containers, its files of mode 400."""
    from kubernetes.client.models import V1SecretVolumeSource, V1Volume, V1VolumeMount

    pod.spec.volumes = [*(pod.spec.volumes or []), V1Volume(
        name=SECRET_VOLUME, secret=V1SecretVolumeSource(secret_name=secret_name, default_mode=0o400))]
    for container in pod.spec.containers:
        container.volume_mounts = [*(container.volume_mounts or []), V1VolumeMount(
            name=SECRET_VOLUME, mount_path=K8S_SECRET_DIR, read_only=True)]


def pass_pod_ip(pod: Any) -> None:
    """``$LLAMARL_STORE_BIND``: the pod's own IP, in each of its containers."""
    from kubernetes.client.models import V1EnvVar, V1EnvVarSource, V1ObjectFieldSelector

    for container in pod.spec.containers:
        container.env = [*(container.env or []), V1EnvVar(
            name=STORE_BIND_ENV, value_from=V1EnvVarSource(field_ref=V1ObjectFieldSelector(field_path="status.podIP")))]


def create_scheduler(session_name: str, client: Optional[Any] = None, docker_client: Optional[Any] = None,
                     **kwargs: Any) -> LlamarlKubernetesScheduler:
    return LlamarlKubernetesScheduler(session_name=session_name, client=client, docker_client=docker_client)
