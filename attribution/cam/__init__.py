"""The CAM family: Grad-CAM and its kin, each call registering and removing its own hook group.

Common semantics (every class here):

* ``cam(inputs, target)`` takes images ``(B, C, H, W)`` (or one ``(C, H, W)`` image, giving ``(H, W)``), a tuple of
  positional inputs, a dict or any ``Mapping`` of keyword inputs (a HuggingFace ``BatchFeature`` with
  ``pixel_values``), or a list of ``(C, H, W)`` images (torchvision detection models), and returns a float tensor
  ``(B, H, W)`` in [0, 1] on the inputs' device: the map at the layer's resolution, bilinearly upsampled
  (``align_corners=False``) to the image size, then min-max scaled per image (an all-zero map stays zero).
  ``upsample=False`` keeps the layer's resolution; ``normalize=False`` returns the raw map.
* ``target``: ``None`` (each item's top class), an integer (Python, numpy, tensor), integers one per item, or a
  callable ``output -> (B,)`` scores (:mod:`attribution.targets`). Class scores are the logits, before any softmax.
* ``layer``: a name, a glob, a module, or a list; with several layers, ``cam(...)`` returns their fused map (the mean
  of the per-layer maps, each upsampled and min-max scaled, then min-max scaled again) and :meth:`layer_maps`
  returns each layer's map.
* The activation used is the layer's true output, recorded before any in-place operation that follows (VGG's
  ``ReLU(inplace=True)``, ResNet's ``out += identity``). When the layer runs several times in one forward, the last
  call is used (with a warning) unless ``call=`` picks one.
* No silent garbage: a warning says when an item's gradient at the layer is all zero (its map is all zero), when a
  4-D output looks channels-last, and when the layer's grid is 1x1.
* The model is left exactly as it was: train/eval flags, grad mode, ``requires_grad``, every ``.grad``, no hook. The
  call itself runs the model in eval mode (compiled models eagerly), without autograd up to the first target layer
  (nothing of the backbone's graph is kept), and with autograd from there to the output.
"""

from .gradient import GradCAM, GradCAMPlusPlus, HiResCAM, LayerCAM, XGradCAM
from .gradient_free import AblationCAM, EigenCAM, ScoreCAM

__all__ = ["AblationCAM", "EigenCAM", "GradCAM", "GradCAMPlusPlus", "HiResCAM", "LayerCAM", "ScoreCAM", "XGradCAM"]
