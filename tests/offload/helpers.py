"""What the offload tests share: copy engines and events they drive by hand, and the
dtypes a round trip must carry bit for bit."""
import weakref

import torch

from actsave.offload import HostCopyEngine

KiB = 1024
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.float8_e4m3fn]


class FakeEvent:
    """A copy's event whose completion the test decides."""

    def __init__(self, done=False):
        self.done = done

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


class RecordingEngine(HostCopyEngine):
    """Copies synchronously, logs what was asked, and keeps the sources it read and the
    events it handed out (which the test may mark unfinished). An offloaded tensor is
    named by its first element."""

    def __init__(self, log):
        self.log = log
        self.sources = []  # weak references
        self.events = []

    def to_host(self, source, host):
        super().to_host(source, host)
        self.sources.append(weakref.ref(source))
        return self._logged("to_host", host)

    def to_device(self, host):
        tensor, _ = super().to_device(host)
        return tensor, self._logged("to_device", host)

    def wait(self, event):
        self.log.append(("wait", event.name))

    def free_after(self, event):
        self.log.append(("free_after", event.name))

    def _logged(self, what, host):
        event = FakeEvent(done=True)
        event.name = int(host.flatten()[0])
        self.log.append((what, event.name))
        self.events.append(event)
        return event
