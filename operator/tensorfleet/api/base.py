"""The API's building blocks: the base model (camelCase on the wire, unknown fields refused), Kubernetes name
and quantity patterns, and the quantity parser. See docs/api.md for the API itself."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

# Kubernetes resource.Quantity in the forms people write (e.g. 500Gi, 16G, 1.5Ti).
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
# A DNS-1035 label: what Service names (and so NAME) must be.
DNS_1035_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS_1123_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
# A label key: an optional DNS-subdomain prefix and `/`, then a name of up to 63 characters.
LABEL_KEY_PATTERN = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                     r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")

# Longest NAME for which every generated name stays a valid label value: the
# StatefulSet controller labels pods `NAME-stage-K-<10-char revision hash>`,
# which must fit in 63 characters with two-digit stage numbers.
MAX_NAME_LENGTH = 43

Quantity = Annotated[str, Field(pattern=QUANTITY_PATTERN)]
_QUANTITY_FACTORS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
                     "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def quantity_bytes(value: str) -> int:
    """A Quantity (QUANTITY_PATTERN: `24Gi`, `16G`, `1.5Ti`, `512000000`) in bytes, rounded down."""
    number = value.rstrip("kMGTPEi")
    suffix = value[len(number):]
    if suffix not in _QUANTITY_FACTORS or not number:
        raise ValueError(f"{value!r} is not a quantity such as 24Gi")
    whole, _, fraction = number.partition(".")
    scale = 10 ** len(fraction)
    return (int(whole + fraction) * _QUANTITY_FACTORS[suffix]) // scale


class ApiModel(BaseModel):
    """Base: camelCase on the wire, unknown fields refused (typos must not pass silently)."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_default=False,
    )
