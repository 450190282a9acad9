# TackleBox 1.0.3, tests/test_remove_hook.py, ported: CPU, random weights, synthetic images (lines marked "port").
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
    hookmngr.register_forward_pre_hook(pre_hook, model.conv1, activate=False, hook_fn_name='pre_hook')
    hookmngr.register_backward_hook(backward_hook, model.conv1)

    hookmngr.remove_module_by_name('conv')

    with hookmngr.hook_all_context():
        model(x).sum().backward()

    hookmngr.register_forward_hook(forward_hook, conv=model.conv1, activate=False)
    hookmngr.register_forward_pre_hook(pre_hook, model.conv1, activate=False)
    hookmngr.register_backward_hook(backward_hook, model.conv1)
    hookmngr.register_forward_hook(forward_hook, pool=model.avgpool)

    hookmngr.remove_hook_function(forward_hook)
    hookmngr.remove_hook_by_name('pre_hook[conv]')

    with hookmngr.hook_all_context():
        model(x).sum().backward()

    hookmngr.register_forward_hook(forward_hook, conv=model.conv1, activate=False)
    hookmngr.register_forward_pre_hook(pre_hook, model.conv1, activate=False)
    hookmngr.register_forward_hook(forward_hook, pool=model.avgpool)

    hookmngr.remove_hook_by_name('pre_hook[conv]')
    hookmngr.remove_hook_function(pre_hook)

    with hookmngr.hook_all_context():
        model(x).sum().backward()

    print(sorted(hookmngr.name_to_hookhandle), sorted(hookmngr.name_to_hookfn), sorted(hookmngr.name_to_module))  # port
