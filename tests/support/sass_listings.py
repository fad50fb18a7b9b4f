"""Hand-written SASS listings for fagen.sass's tests, in the text `cuobjdump -sass` prints."""


def listing(body: str, name: str = "k") -> str:
    """A cuobjdump-style listing from lines `ADDR  INSTRUCTION` (addresses in hex)."""
    lines = [f"\t\tFunction : {name}"]
    for line in body.strip().splitlines():
        address, text = line.split(None, 1)
        lines.append(f"        /*{int(address, 16):04x}*/                   {text} ;   /* 0x0000000000000000 */")
    return "\n".join(lines)
