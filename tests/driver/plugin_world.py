"""One fake API server, the plugin in this process talking to it, and a kubelet stand-in
registered over the real sockets: the setting of the prepare tests that need no subprocess."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from tests.driver.kubelet_standin import KubeletStandin
from tests.driver.plugin_process import InProcessPlugin
from tests.fakes.apiserver import FakeApiServer


class PluginWorld:
    def __init__(self, server: FakeApiServer | None = None, **plugin: Any) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="vgw", dir="/tmp"))  # short socket paths
        self.server = server if server is not None else FakeApiServer()
        self.server.up()
        self.plugin = InProcessPlugin(self.root, self.server.api_client(), **plugin)
        self.plugin.driver.start()
        self.kubelet = KubeletStandin(self.plugin.registration_socket)
        self.kubelet.register()

    def close(self) -> None:
        self.kubelet.close()
        self.plugin.driver.stop()
        self.server.down()
        shutil.rmtree(self.root, ignore_errors=True)
