"""The one door into DeepSpeed (lazyzero/patch_point.py): its table matches the installed DeepSpeed and
every change lazyzero makes, its refusals hold, and no other file of the package changes DeepSpeed."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
from pathlib import Path

import deepspeed
import pytest
import torch
from deepspeed.runtime.zero import stage3, utils
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from packaging.version import Version

from lazyzero.checkpoint.lazy_engine import LazyCheckpointEngine
from lazyzero.engine.engine import LazyZeroEngine
from lazyzero.optimizer import clipping
from lazyzero.optimizer.nvme_swap import EightBitStateSwapper
from lazyzero.patch_point import (
    EXTEND,
    PATCH_POINTS,
    REDIRECT,
    REPLACE,
    ROUTE,
    SET,
    SWAP,
    TESTED_DEEPSPEED,
    WRAP,
    PatchRefused,
    applied_patches,
    clear_state,
    deepspeed_internals_problems,
    extend_list,
    original_callable,
    original_function,
    original_parameters,
    redirect_function,
    replace_method,
    resolve_target,
    set_state,
    state_is_used,
    swapped,
    unredirect_function,
    wrap_method,
)
from lazyzero.plan.deepspeed.zero_placement import TieredZeroOptimizer_Stage3

PACKAGE = Path(__file__).resolve().parents[2] / "lazyzero"
DOOR = PACKAGE / "patch_point.py"
DOORS = {"replace_method": REPLACE, "wrap_method": WRAP, "swapped": SWAP, "extend_list": EXTEND,
         "route_function": ROUTE, "redirect_function": REDIRECT, "set_state": SET}
# Assignments the checker below cannot tell from DeepSpeed's: (file, attribute) -> whose object it is.
NOT_DEEPSPEED: dict[tuple[str, str], str] = {}
LIST_CHANGES = {"append", "extend", "insert", "remove", "pop", "clear"}


def bare(cls):
    """An instance without DeepSpeed's constructor: enough to patch and call a replaced method."""
    return cls.__new__(cls)


# ----------------------------------------------------------------------------------- the table

@pytest.mark.parametrize("point", PATCH_POINTS, ids=lambda point: point.target)
def test_each_declared_attribute_exists_in_the_installed_deepspeed_as_declared(point):
    pytest.importorskip(point.target.partition(".")[0].partition(":")[0])  # a trainer's, where it is installed
    if point.kind == SET:
        assert point.parameters is None and state_is_used(point)
        return
    value = resolve_target(point.target)
    if point.kind == EXTEND:
        assert isinstance(value, list) and point.parameters is None
    else:
        assert callable(value)
        assert original_parameters(value) == point.parameters_in(deepspeed.__version__)


def test_the_tested_deepspeed_range_is_the_one_pyproject_declares_and_names_every_other_version():
    requirement = next(line.strip().strip('",') for line in (PACKAGE.parent / "pyproject.toml").read_text().splitlines()
                       if line.strip().startswith('"deepspeed'))
    lowest, highest = TESTED_DEEPSPEED
    assert requirement == f"deepspeed>={lowest},<={highest}"
    for point in PATCH_POINTS:
        for version, _ in point.other_versions:
            assert Version(lowest) <= Version(version) < Version(highest), (point.target, version)


SUBCLASSES = (LazyZeroEngine, LazyCheckpointEngine, TieredZeroOptimizer_Stage3, EightBitStateSwapper)
POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


@pytest.mark.parametrize("subclass", SUBCLASSES, ids=lambda cls: cls.__name__)
def test_every_override_in_a_lazyzero_subclass_accepts_the_arguments_of_the_installed_deepspeeds_method(subclass):
    """DeepSpeed calls an override as it calls its own method, whose parameters may change between the
    tested versions (0.19.7's engine passes `_take_model_step` a second argument). Constructors are
    left out: lazyzero calls its own with its own arguments."""
    overridden = 0
    for name, override in vars(subclass).items():
        base = next((cls for cls in subclass.__mro__[1:] if name in vars(cls)
                     and cls.__module__.startswith("deepspeed.")), None)
        if not inspect.isfunction(override) or name == "__init__" or base is None:
            continue
        parameters = inspect.signature(original_callable(vars(base)[name])).parameters.values()
        positional = [None for parameter in parameters if parameter.kind in POSITIONAL]
        keywords = {parameter.name: None for parameter in parameters
                    if parameter.kind == inspect.Parameter.KEYWORD_ONLY}
        inspect.signature(original_callable(override)).bind(*positional, **keywords)
        overridden += 1
    assert overridden


def test_the_internals_check_passes_here_and_names_a_changed_signature_with_the_version(monkeypatch):
    assert deepspeed_internals_problems() == []
    monkeypatch.setattr(DeepSpeedZeroOptimizer, "average_tensor", lambda self, tensor: None)
    monkeypatch.delattr(DeepSpeedZeroOptimizer_Stage3, "_get_norm_groups")
    problems = deepspeed_internals_problems()
    assert len(problems) == 2
    assert "average_tensor: takes ('tensor',)" in problems[0] and deepspeed.__version__ in problems[0]
    assert "_get_norm_groups: missing" in problems[1]


def door_calls(path: Path) -> list[tuple[str, str]]:
    """(door function, attribute name) of every call of the door in `path`; the name may be a string,
    or a module-level string constant plus a string (the name-mangled stage-3 methods)."""
    tree = ast.parse(path.read_text(), str(path))
    constants = {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 for target in node.targets if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant)}

    def text(node) -> str:
        if isinstance(node, ast.BinOp):
            return text(node.left) + text(node.right)
        return constants[node.id] if isinstance(node, ast.Name) else node.value

    return [(node.func.id, text(node.args[1])) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in DOORS]


def test_the_table_lists_every_attribute_the_package_changes_and_no_other():
    used = {(DOORS[door], name) for path in PACKAGE.rglob("*.py") if path != DOOR for door, name in door_calls(path)}
    declared = {(point.kind, point.attribute) for point in PATCH_POINTS}
    assert used == declared


# ---------------------------------------------------------------------------- the four doors

def test_replace_changes_one_object_and_records_it():
    patched, other = bare(DeepSpeedZeroOptimizer), bare(DeepSpeedZeroOptimizer)
    replace_method(patched, "average_tensor", lambda tensor, communication_data_type: "int8", owner="test")
    assert patched.average_tensor(None, None) == "int8"
    assert "average_tensor" not in vars(other)
    assert DeepSpeedZeroOptimizer.average_tensor is not vars(patched)["average_tensor"]
    last = applied_patches()[-1]
    assert (last.target, last.attribute, last.holder, last.owner, last.over_override) == (
        "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.average_tensor", "average_tensor",
        "DeepSpeedZeroOptimizer", "test", None)
    assert last.deepspeed_version == __import__("deepspeed").__version__


def test_replace_refuses_an_undeclared_name_a_wrong_kind_and_other_parameters():
    optimizer = bare(DeepSpeedZeroOptimizer)
    with pytest.raises(PatchRefused, match="not declared|no class of its MRO declares"):
        replace_method(optimizer, "reduce_gradients", lambda pipeline_parallel=False: None, owner="test")
    with pytest.raises(PatchRefused, match="declared as wrap"):
        replace_method(optimizer, "_update_scale", lambda has_overflow: None, owner="test")
    with pytest.raises(PatchRefused, match="takes \\('tensor',\\)"):
        replace_method(optimizer, "average_tensor", lambda tensor: None, owner="test")
    assert vars(optimizer) == {}


def test_a_second_change_of_one_method_on_one_object_is_refused_naming_both_owners():
    optimizer = bare(DeepSpeedZeroOptimizer_Stage3)
    replace_method(optimizer, "unscale_and_clip_grads", lambda sub_group_id, total_norm: None, owner="first feature")
    with pytest.raises(PatchRefused, match="second feature.*first feature"):
        replace_method(optimizer, "unscale_and_clip_grads", lambda sub_group_id, total_norm: None,
                       owner="second feature")
    wrap_method(optimizer, "_update_scale", lambda original, has_overflow=False: None, owner="first feature")
    with pytest.raises(PatchRefused, match="second feature.*first feature"):
        wrap_method(optimizer, "_update_scale", lambda original, has_overflow=False: None, owner="second feature")


class OverridingStep(torch.optim.SGD):
    def step(self, closure=None):
        return "the override"


def test_wrap_calls_the_method_the_object_resolved_overrides_included():
    optimizer = OverridingStep([torch.zeros(1, requires_grad=True)], lr=0.1)
    wrap_method(optimizer, "step", lambda step, *args: ("guarded", step(*args)), owner="test")
    assert optimizer.step() == ("guarded", "the override")
    assert applied_patches()[-1].target == "torch.optim.optimizer:Optimizer.step"


def test_swap_restores_on_exit_and_on_error_and_refuses_nesting_naming_both_owners():
    original = stage3.PartitionedOptimizerSwapper
    with swapped(stage3, "PartitionedOptimizerSwapper", "stand-in", owner="outer"):
        assert stage3.PartitionedOptimizerSwapper == "stand-in"
        assert applied_patches()[-1].target == "deepspeed.runtime.zero.stage3:PartitionedOptimizerSwapper"
        with pytest.raises(PatchRefused, match="inner.*outer"), \
                swapped(stage3, "PartitionedOptimizerSwapper", "second", owner="inner"):
            pass
        assert stage3.PartitionedOptimizerSwapper == "stand-in"
    assert stage3.PartitionedOptimizerSwapper is original
    with pytest.raises(ValueError), swapped(stage3, "PartitionedOptimizerSwapper", "stand-in", owner="outer"):
        raise ValueError("while building")
    assert stage3.PartitionedOptimizerSwapper is original
    with pytest.raises(PatchRefused, match="not declared"), \
            swapped(stage3, "DeepSpeedZeroOptimizer", "stand-in", owner="test"):
        pass


def test_extend_appends_once_and_records_once():
    class Untested(torch.optim.SGD):
        pass

    before = len(applied_patches())
    try:
        extend_list(utils, "ZERO_SUPPORTED_OPTIMIZERS", Untested, owner="test")
        extend_list(utils, "ZERO_SUPPORTED_OPTIMIZERS", Untested, owner="test")
        assert utils.ZERO_SUPPORTED_OPTIMIZERS.count(Untested) == 1
        assert [patch.target for patch in applied_patches()[before:]] == [
            "deepspeed.runtime.zero.utils:ZERO_SUPPORTED_OPTIMIZERS"]
    finally:
        utils.ZERO_SUPPORTED_OPTIMIZERS.remove(Untested)


def test_set_assigns_declared_state_records_it_once_and_refuses_the_undeclared():
    zero = bare(DeepSpeedZeroOptimizer_Stage3)
    before = len(applied_patches())
    set_state(zero, "overflow", True, owner="test set")
    set_state(zero, "overflow", False, owner="test set")
    assert zero.overflow is False
    assert [patch.target for patch in applied_patches()[before:]] == [
        "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.overflow"]
    module = torch.nn.Linear(1, 1)
    set_state(module, "forward", lambda x: x + 1, owner="test set", holder="torch.nn.modules.module:Module")
    assert module(torch.zeros(1)).item() == 1
    clear_state(module, "forward", owner="test set", holder="torch.nn.modules.module:Module")
    assert module(torch.zeros(1)).shape == (1,)
    with pytest.raises(PatchRefused, match="not declared"):
        set_state(module, "weight", None, owner="test set", holder="torch.nn.modules.module:Module")
    with pytest.raises(PatchRefused, match="declares it"):
        set_state(zero, "loss_scale_typo", 1.0, owner="test set")


def test_redirect_reaches_names_bound_before_it_and_unredirect_gives_the_code_back(tmp_path):
    """A script's `from transformers.trainer_utils import get_last_checkpoint` binds the function
    object before any patch; the redirect changes what that object does, for every name bound to it."""
    trainer_utils = pytest.importorskip("transformers.trainer_utils")
    bound_before, code = trainer_utils.get_last_checkpoint, trainer_utils.get_last_checkpoint.__code__

    def newest(folder):
        return ("lazyzero's", original_function(trainer_utils, "get_last_checkpoint")(folder))

    redirect_function(trainer_utils, "get_last_checkpoint", newest, owner="test")
    try:
        redirect_function(trainer_utils, "get_last_checkpoint", newest, owner="test")  # again: nothing
        with pytest.raises(PatchRefused, match="already redirected by test"):
            redirect_function(trainer_utils, "get_last_checkpoint", lambda folder: None, owner="other")
        with pytest.raises(PatchRefused, match="other undoes the redirect"):
            unredirect_function(trainer_utils, "get_last_checkpoint", owner="other")
        assert bound_before(str(tmp_path)) == ("lazyzero's", None)
        assert inspect.signature(bound_before) == inspect.signature(original_function(trainer_utils,
                                                                                      "get_last_checkpoint"))
        assert applied_patches()[-1].target == "transformers.trainer_utils:get_last_checkpoint"
    finally:
        assert unredirect_function(trainer_utils, "get_last_checkpoint", owner="test")
    assert bound_before is trainer_utils.get_last_checkpoint and bound_before.__code__ is code
    assert not unredirect_function(trainer_utils, "get_last_checkpoint", owner="test")
    with pytest.raises(PatchRefused, match="takes \\('folder', 'other'\\)"):
        redirect_function(trainer_utils, "get_last_checkpoint", lambda folder, other: None, owner="test")


# ------------------------------------------------------ replacing over a lazyzero subclass's override

def test_replacing_a_method_a_lazyzero_subclass_overrides_needs_a_reason():
    """TieredZeroOptimizer_Stage3 overrides _get_norm_groups; a replacement on its objects would hide it."""
    tiered = bare(TieredZeroOptimizer_Stage3)
    with pytest.raises(PatchRefused, match="TieredZeroOptimizer_Stage3 overrides.*over_override"):
        replace_method(tiered, "_get_norm_groups", lambda: [], owner="test")
    assert "_get_norm_groups" not in vars(tiered)
    replace_method(tiered, "_get_norm_groups", lambda: [], owner="test", over_override="because")
    assert applied_patches()[-1].over_override == "because"


def test_fused_clipping_says_why_it_may_hide_the_tiered_norm_order():
    clipping.install_on_stage_3(bare(TieredZeroOptimizer_Stage3))
    norm, clip = applied_patches()[-2:]
    assert norm.attribute == "_get_norm_groups" and norm.over_override == clipping._OVER_TIERED_NORM
    assert clip.attribute == "unscale_and_clip_grads" and clip.over_override is None
    clipping.install_on_stage_3(bare(DeepSpeedZeroOptimizer_Stage3))
    assert applied_patches()[-2].over_override is None  # DeepSpeed's own class: nothing hidden


# ------------------------------------------------------- nothing else in the package changes DeepSpeed

def _installed(target: str) -> bool:
    """Whether the library a declared target lives in is installed (Lightning is optional)."""
    return importlib.util.find_spec(target.partition(":")[0].partition(".")[0]) is not None


def deepspeed_method_names() -> set[str]:
    """Names of the methods DeepSpeed's classes in the table define (their DeepSpeed bases too), less
    the names DeepSpeed's own modules use as data on self (the engine's `dynamic_loss_scale()` is a
    flag on the ZeRO optimizers)."""
    classes = {resolve_target(point.target.rpartition(".")[0]) for point in PATCH_POINTS
               if "." in point.target.partition(":")[2] and _installed(point.target)}
    bases = {base for cls in classes for base in cls.__mro__ if base.__module__.startswith("deepspeed.")}
    methods = {name for base in bases for name, value in vars(base).items() if inspect.isfunction(value)}
    data = {name for module in {inspect.getmodule(base) for base in bases}
            for name in re.findall(r"\bself\.(\w+)\s*=[^=]", inspect.getsource(module))}
    return methods - data


def deepspeed_names(tree: ast.AST) -> set[str]:
    """Names bound in a file to DeepSpeed modules or their members (imports at any depth)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names
                      if alias.name.split(".")[0] == "deepspeed"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "deepspeed":
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def changes_outside_the_door(path: Path, source: str, method_names: set[str]) -> list[str]:
    """Each line of `source` that changes DeepSpeed by hand: types.MethodType, setattr on anything
    but self, an assignment to an attribute of a name imported from deepspeed or a list method called
    on one, or an assignment of a DeepSpeed method name on anything but self."""
    tree = ast.parse(source, str(path))
    imported = deepspeed_names(tree)
    found = []
    for node in ast.walk(tree):
        if "MethodType" in (getattr(node, "id", None), getattr(node, "attr", None), getattr(node, "name", None)):
            found.append(f"{path}:{node.lineno}: MethodType")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            if not (isinstance(node.args[0], ast.Name) and node.args[0].id == "self"):
                found.append(f"{path}:{node.lineno}: setattr on {ast.unparse(node.args[0])}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LIST_CHANGES
              and isinstance(node.func.value, ast.Name) and node.func.value.id in imported):
            found.append(f"{path}:{node.lineno}: {ast.unparse(node.func)} of DeepSpeed called")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for attribute in (sub for target in targets for sub in ast.walk(target) if isinstance(sub, ast.Attribute)):
                base = attribute.value
                if isinstance(base, ast.Name) and base.id in imported:
                    found.append(f"{path}:{node.lineno}: {ast.unparse(attribute)} of DeepSpeed assigned")
                elif (attribute.attr in method_names and not (isinstance(base, ast.Name) and base.id == "self")
                      and (str(path), attribute.attr) not in NOT_DEEPSPEED):
                    found.append(f"{path}:{node.lineno}: method {ast.unparse(attribute)} assigned")
    return found


def test_no_file_but_the_door_changes_deepspeed():
    names = deepspeed_method_names()
    found = [line for path in sorted(PACKAGE.rglob("*.py")) if path != DOOR
             for line in changes_outside_the_door(path.relative_to(PACKAGE.parent), path.read_text(), names)]
    assert not found, "change DeepSpeed through lazyzero/patch_point.py:\n" + "\n".join(found)


@pytest.mark.parametrize("text", [
    "import types\ndef f(o, g):\n    o.step = types.MethodType(g, o)\n",
    "from types import MethodType\n",
    "def f(optimizer, g):\n    setattr(optimizer, '_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads', g)\n",
    "def f(g):\n    from deepspeed.runtime.zero import stage3\n    stage3.PartitionedOptimizerSwapper = g\n",
    "from deepspeed.runtime.zero.partition_parameters import Init\nInit._partition_param = None\n",
    "import deepspeed.comm as dist\ndist.all_reduce = None\n",
    "import deepspeed\ndeepspeed.runtime.engine.DeepSpeedEngine.step = None\n",
    "def f(zero_optimizer, g):\n    zero_optimizer._get_norm_groups = g\n",
    "def f(engine, g):\n    engine.optimizer.average_tensor = g\n",
    "def f(c):\n    from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS\n"
    "    ZERO_SUPPORTED_OPTIMIZERS.append(c)\n",
])
def test_the_checker_sees_every_form_of_change(text):
    """The test above can fail: each hand-made change is found."""
    assert changes_outside_the_door(Path("lazyzero/x.py"), text, deepspeed_method_names())


@pytest.mark.parametrize("text", [
    "class A:\n    def f(self, g):\n        setattr(self, 'x', g)\n        self.step = g\n",
    "def f(optimizer):\n    optimizer.overflow = True\n",
])
def test_the_checker_lets_own_state_and_deepspeed_data_be(text):
    assert not changes_outside_the_door(Path("lazyzero/x.py"), text, deepspeed_method_names())
