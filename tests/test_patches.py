"""graphsan's one way of wrapping other code's attributes (graphsan.core.patches)."""

from __future__ import annotations

import types

from graphsan.core.patches import Patches


class Base:
    def f(self):
        return "base f"


class Child(Base):
    def g(self):
        return "child g"


def test_own_and_inherited_attributes_come_back_exactly_in_reverse_order():
    p = Patches()
    orig_g = Child.__dict__["g"]
    p.set(Child, "f", lambda self: "patched f")  # inherited: Child had no f of its own
    p.set(Child, "g", lambda self: "patched g")
    p.set(Child, "g", lambda self: "patched twice")
    assert (Child().f(), Child().g(), len(p)) == ("patched f", "patched twice", 3)
    p.restore()
    assert "f" not in vars(Child) and Child().f() == "base f"
    assert vars(Child)["g"] is orig_g and not p
    p.restore()  # idempotent
    assert Child().g() == "child g"


def test_a_module_attribute_that_did_not_exist_is_removed_again_and_patches_can_start_over():
    mod = types.ModuleType("fake_torch_cuda")
    mod.empty_cache = lambda: "orig"
    p = Patches()
    p.set(mod, "empty_cache", lambda: "wrapped")
    p.set(mod, "new_thing", 1)
    p.restore()
    assert mod.empty_cache() == "orig" and not hasattr(mod, "new_thing")
    p.set(mod, "empty_cache", lambda: "again")
    assert mod.empty_cache() == "again"
    p.restore()
    assert mod.empty_cache() == "orig"


def test_an_attribute_someone_else_removed_meanwhile_does_not_break_restore():
    mod = types.ModuleType("m")
    p = Patches()
    p.set(mod, "added", 1)
    del mod.added
    p.restore()
    assert not hasattr(mod, "added")
