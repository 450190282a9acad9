# TackleBox 1.0.3, tests/test_retain_forward_cache.py, ported: CPU, random weights, synthetic images ("port").
from torchvision.models import resnet18
import torch
from tacklebox.hooks.model_tracking import ModuleTracker


def print_out_with_grad(module, grad_in, grad_out, inputs, outputs):
    print('%s output-gradient pairs: ' % module.name, end='')
    for out, grad in zip(outputs, grad_out):
        print(out.dtype, type(grad), end=' ')
    print('')


if __name__ == '__main__':
    torch.manual_seed(0)  # port
    model = resnet18()

    x = torch.rand(1, 3, 64, 64)  # port: one CIFAR100 image resized to 224x224

    from tacklebox.hook_management import HookManager

    hookmngr = HookManager()

    hookmngr.register_backward_hook(print_out_with_grad, conv=model.conv1, retain_forward_cache=True)

    with hookmngr.hook_all_context():
        model(x).sum().backward()
