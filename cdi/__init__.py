"""CDI (Container Device Interface) specs: a typed model, schema validation and spec files."""

from cdi.schema import SchemaError, validate
from cdi.spec import ContainerEdits, Device, DeviceNode, Hook, Mount, Spec, SpecError
from cdi.writer import SpecWriter

__all__ = [
    "ContainerEdits",
    "Device",
    "DeviceNode",
    "Hook",
    "Mount",
    "SchemaError",
    "Spec",
    "SpecError",
    "SpecWriter",
    "validate",
]
