# TackleBox 1.0.3, tests/test.py, ported: CPU, random weights, synthetic images (lines marked "port").
from torchvision.models import resnet18
import torch
from tacklebox.hooks.model_tracking import ModuleTracker


def pre_hook(module, inputs):
    print('setting %s input to zero' % module.name)
    input, = inputs
    return (input - input,)


def forward_hook(module, inputs, outputs):
    print('%s input shape: %s, output shape: %s' % (module.name, repr(inputs[0].shape), repr(outputs[0].shape)))


def backward_hook(module, grad_in, grad_out):
    print('in %s backward hook' % module.name)


if __name__ == '__main__':
    torch.manual_seed(0)  # port
    model = resnet18()

    x = torch.rand(1, 3, 64, 64)  # port: one CIFAR100 image resized to 224x224

    from tacklebox.hook_management import HookManager
    hookmngr = HookManager()

    hookmngr.register_forward_hook(forward_hook, conv=model.conv1, activate=False)
    hookmngr.register_forward_pre_hook(pre_hook, model.conv1, activate=False)
    hookmngr.register_backward_hook(backward_hook, model.conv1)

    model(x).sum().backward()
    hookmngr.deactivate_module_hooks(model.conv1)

    tracker = ModuleTracker(model.layer1[0].conv1, pooling=model.avgpool)
    with tracker.track():
        model(x).sum().backward()
        raw = tracker.gather()

    # try using category in HookManager context
    hookmngr = tracker.hook_manager
    with hookmngr.hook_all_context(category='forward_hook'):
        model(x).sum().backward()
        raw2 = tracker.gather()

    with hookmngr.hook_all_context(category='backward_hook'):
        model(x).sum().backward()
        raw3 = tracker.gather()

    for r in (raw, raw2, raw3):  # port: show what was gathered
        print({name: {var: tuple(t.shape) for var, t in data.items()} for name, data in sorted(r.items())})
