"""What the cluster's administrators allow, and which names would collide: checks shared by webhook and reconciler,
both of which run every one, so an InferenceService admitted before a policy changed (or while the webhook was
unreachable) is still held to it. Pure functions: the caller fetches what they need.
Design: docs/security.md#people-who-may-create-inferenceservices.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tensorfleet.api import InferenceService, SpecError

DEFAULT_REGISTRY = "docker.io"


def normalize_image(image: str) -> str:
    """The image reference with its registry spelled out, as the container runtime resolves it.

    `vllm/vllm-openai:v0.19` is `docker.io/vllm/vllm-openai:v0.19`, `ubuntu` is
    `docker.io/library/ubuntu`; a first component with a dot or a colon, or
    `localhost`, is a registry host.
    """
    first, _, rest = image.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return image
    if not rest:
        return f"{DEFAULT_REGISTRY}/library/{image}"
    return f"{DEFAULT_REGISTRY}/{image}"


def image_allowed(image: str, allowed: Sequence[str]) -> bool:
    """Whether `image` lies under one of the `allowed` prefixes (a registry host, or host/path), none: anything."""
    if not allowed:
        return True
    reference = normalize_image(image)
    return any(reference.startswith(prefix.rstrip("/") + "/") for prefix in allowed)


def check_images(isvc: InferenceService, allowed: Sequence[str]) -> None:
    """Raise SpecError naming the field of the first image the registry policy does not allow.

    Only images the manifest names are checked: the operator's own defaults
    are the administrator's choice.
    """
    if not allowed:
        return
    for field, image in (("spec.engine.image", isvc.spec.engine.image), ("spec.router.image", isvc.spec.router.image)):
        if image and not image_allowed(image, allowed):
            raise SpecError(field, f"{image} is not from an allowed registry ({', '.join(allowed)}); "
                                   "use an image from one of those, or ask the cluster's administrators to allow it "
                                   "(tensorfleet run --allowed-registries)")


def colliding_owner_names(name: str, children: Iterable[tuple[str, str]]) -> set[str]:
    """Names of other InferenceServices whose children could share a (kind, name) with `name`'s `children`.

    Every child name is the InferenceService's name plus a suffix (possibly
    empty). Two InferenceServices N and M collide when N + s1 == M + s2 for
    two suffixes of the same kind; with the suffixes read off N's own children,
    M is N's child name with some suffix taken off. The caller looks each
    candidate up and compares what it renders.
    """
    names = [child for _, child in children]
    suffixes = {child[len(name):] for child in names if child.startswith(name)}
    found = set()
    for child in names:
        for suffix in suffixes:
            if child.endswith(suffix):
                other = child[:len(child) - len(suffix)] if suffix else child
                if other and other != name:
                    found.add(other)
    return found
