"""Objects the registry tests patch (no transformers involved)."""


def greet(name: str = "world") -> str:
    return f"hello {name}"


class Box:
    def size(self) -> int:
        return 1


REGISTRY = {"greet": greet}
