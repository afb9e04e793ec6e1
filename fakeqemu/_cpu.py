"""``-cpu MODEL``: the x86 CPU models QEMU 7.2 knows, and ``host``'s need for KVM.

fakeqemu runs no guest code, so every model is as good as another to it; it
checks only what QEMU checks (measured on QEMU 7.2): that the model exists
(``unable to find CPU model 'x'``) and that ``host`` runs only under KVM.
"""

from __future__ import annotations

from fakeqemu._qemuopts import CommandLineError

# ``qemu-system-x86_64 -cpu help`` of QEMU 7.2 (Debian 1:7.2+dfsg-7+deb12u18).
_MODEL_NAMES = """
    486 486-v1 Broadwell Broadwell-IBRS Broadwell-noTSX Broadwell-noTSX-IBRS
    Broadwell-v1 Broadwell-v2 Broadwell-v3 Broadwell-v4 Cascadelake-Server
    Cascadelake-Server-noTSX Cascadelake-Server-v1 Cascadelake-Server-v2
    Cascadelake-Server-v3 Cascadelake-Server-v4 Cascadelake-Server-v5 Conroe Conroe-v1
    Cooperlake Cooperlake-v1 Cooperlake-v2 Denverton Denverton-v1 Denverton-v2
    Denverton-v3 Dhyana Dhyana-v1 Dhyana-v2 EPYC EPYC-IBPB EPYC-Milan EPYC-Milan-v1
    EPYC-Rome EPYC-Rome-v1 EPYC-Rome-v2 EPYC-v1 EPYC-v2 EPYC-v3 Haswell Haswell-IBRS
    Haswell-noTSX Haswell-noTSX-IBRS Haswell-v1 Haswell-v2 Haswell-v3 Haswell-v4
    Icelake-Server Icelake-Server-noTSX Icelake-Server-v1 Icelake-Server-v2
    Icelake-Server-v3 Icelake-Server-v4 Icelake-Server-v5 Icelake-Server-v6 IvyBridge
    IvyBridge-IBRS IvyBridge-v1 IvyBridge-v2 KnightsMill KnightsMill-v1 Nehalem
    Nehalem-IBRS Nehalem-v1 Nehalem-v2 Opteron_G1 Opteron_G1-v1 Opteron_G2 Opteron_G2-v1
    Opteron_G3 Opteron_G3-v1 Opteron_G4 Opteron_G4-v1 Opteron_G5 Opteron_G5-v1 Penryn
    Penryn-v1 SandyBridge SandyBridge-IBRS SandyBridge-v1 SandyBridge-v2 Skylake-Client
    Skylake-Client-IBRS Skylake-Client-noTSX-IBRS Skylake-Client-v1 Skylake-Client-v2
    Skylake-Client-v3 Skylake-Client-v4 Skylake-Server Skylake-Server-IBRS
    Skylake-Server-noTSX-IBRS Skylake-Server-v1 Skylake-Server-v2 Skylake-Server-v3
    Skylake-Server-v4 Skylake-Server-v5 Snowridge Snowridge-v1 Snowridge-v2 Snowridge-v3
    Snowridge-v4 Westmere Westmere-IBRS Westmere-v1 Westmere-v2 athlon athlon-v1
    core2duo core2duo-v1 coreduo coreduo-v1 kvm32 kvm32-v1 kvm64 kvm64-v1 n270 n270-v1
    pentium pentium-v1 pentium2 pentium2-v1 pentium3 pentium3-v1 phenom phenom-v1 qemu32
    qemu32-v1 qemu64 qemu64-v1 base host max
    """
CPU_MODELS = frozenset(_MODEL_NAMES.split())


def check_cpu_model(value: str, accelerator: str) -> str:
    """The model ``-cpu VALUE`` names, checked against the accelerator QEMU settled on."""
    model, comma, _ = value.partition(",")
    if model not in CPU_MODELS:
        raise CommandLineError(f"unable to find CPU model '{model}'")
    if comma:
        raise CommandLineError("fakeqemu does not emulate CPU properties")
    if model == "host" and accelerator != "kvm":
        raise CommandLineError("CPU model 'host' requires KVM or HVF")
    return model
