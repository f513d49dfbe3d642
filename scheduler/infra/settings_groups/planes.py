"""The API's listeners: planes, allow-lists, TLS (``settings.planes``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode

from scheduler.access.networks import normalised_networks
from scheduler.infra.settings_groups.base import SettingsGroup, split_list

NetworkList = Annotated[list[str], NoDecode]


class PlaneSettings(SettingsGroup):
    """Where the API's three planes listen, who may reach each, and their TLS (docs/security.md).

    Public plane: jobs, batches, decisions, the OpenAI routes, events. Admin plane: ``/v1/admin``
    and the dashboard. Ops plane: ``/metrics``, ``/livez``, ``/healthz``, ``/readyz``. With
    neither ``admin_port`` nor ``ops_port`` set, one listener serves all three (one-port mode, for
    development); with them set, each plane has its own listener and the others answer 404 for
    its paths.
    """

    admin_port: int | None = Field(
        None, ge=0, le=65535, description="Port of the admin plane's own listener (unset: the admin "
        "plane is served on the public port).")
    admin_host: str = Field("127.0.0.1", description="Interface the admin listener binds (loopback: "
                            "reachable only from this host or through a proxy of yours).")
    ops_port: int | None = Field(
        None, ge=0, le=65535, description="Port of the ops plane's own listener (unset: the ops plane is "
        "served on the admin port when there is one, else on the public port).")
    ops_host: str = Field("127.0.0.1", description="Interface the ops listener binds.")
    public_allowed_networks: NetworkList = Field(
        default_factory=list, description="CIDR networks (comma-separated or a JSON list) allowed to "
        "call the public plane; empty: any address.")
    admin_allowed_networks: NetworkList = Field(
        default_factory=list, description="CIDR networks allowed to call the admin plane; empty: any.")
    ops_allowed_networks: NetworkList = Field(
        default_factory=list, description="CIDR networks allowed to call the ops plane; empty: any.")
    trusted_proxies: NetworkList = Field(
        default_factory=list, description="CIDR networks of proxies whose X-Forwarded-For / Forwarded "
        "headers are believed (the right-most hop that is not a trusted proxy is the client); empty: "
        "the socket's peer is always the client.")
    tls_cert_file: Path | None = Field(
        None, description="PEM certificate (chain) of the public listener; with tls_key_file the API "
        "serves HTTPS. Also the admin and ops listeners' unless they have their own.")
    tls_key_file: Path | None = Field(None, description="PEM private key of tls_cert_file.")
    admin_tls_cert_file: Path | None = Field(None, description="PEM certificate of the admin listener.")
    admin_tls_key_file: Path | None = Field(None, description="PEM private key of admin_tls_cert_file.")
    admin_tls_client_ca_file: Path | None = Field(
        None, description="PEM CA bundle: the admin listener then requires a client certificate it "
        "signed (mutual TLS); a client without one is refused in the TLS handshake.")
    ops_tls_cert_file: Path | None = Field(None, description="PEM certificate of the ops listener.")
    ops_tls_key_file: Path | None = Field(None, description="PEM private key of ops_tls_cert_file.")
    drain_seconds: float = Field(
        0.0, ge=0, le=300, alias="api_drain_seconds", description="cloverq api: after SIGTERM the replica "
        "keeps serving this long while /readyz and /readyz/replica answer 503, so a load balancer takes it "
        "out before its listeners close; long polls answer and event streams end by then (api/drain.py). "
        "Behind a load balancer set it above the time it takes to mark a server down (HAProxy: inter x "
        "fall); 0: close at once.")
    stop_grace_seconds: float = Field(
        10.0, gt=0, alias="api_stop_grace_seconds", description="cloverq api: after the listeners close, "
        "how long requests still running (OpenAI streams and blocking answers) may go on before they are "
        "cut; a cut OpenAI stream cancels its job.")

    @field_validator("public_allowed_networks", "admin_allowed_networks", "ops_allowed_networks",
                     "trusted_proxies", mode="before")
    @classmethod
    def _split_list(cls, value: Any) -> Any:
        return split_list(value)

    @field_validator("public_allowed_networks", "admin_allowed_networks", "ops_allowed_networks",
                     "trusted_proxies")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        return normalised_networks(value)  # a ValueError refuses the setting

    @model_validator(mode="after")
    def _pairs(self) -> PlaneSettings:
        pairs = (("tls_cert_file", "tls_key_file"), ("admin_tls_cert_file", "admin_tls_key_file"),
                 ("ops_tls_cert_file", "ops_tls_key_file"))
        for cert, key in pairs:
            if (getattr(self, cert) is None) != (getattr(self, key) is None):
                raise ValueError(f"{cert} and {key} go together: set both or neither")
        if self.admin_tls_client_ca_file is not None and self.admin_tls_cert_file is None \
                and self.tls_cert_file is None:
            raise ValueError("admin_tls_client_ca_file needs the admin listener to serve TLS "
                             "(admin_tls_cert_file or tls_cert_file)")
        return self

    @property
    def split(self) -> bool:
        """Whether the admin or ops plane has a listener of its own."""
        return self.admin_port is not None or self.ops_port is not None
