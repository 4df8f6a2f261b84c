"""eSpeak NG in process: its C library (``libespeak-ng``) and data from the ``espeakng-loader``
wheel, driven through ``ctypes`` with its synchronous synthesis API.

The library keeps one global state per process (voice, rate, the synthesis callback), so there is
one ``Espeak`` per process and one synthesis at a time (a lock); a synthesis of a sentence takes
milliseconds. Its audio is 16-bit mono at the library's rate (22,050 Hz), returned as float32.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Final

import numpy as np

from worker_service.model import FloatArray

_AUDIO_OUTPUT_SYNCHRONOUS: Final = 2
_POS_CHARACTER: Final = 1
_CHARS_UTF8: Final = 1
_RATE: Final = 1  # espeakRATE: words per minute
_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)

_instance: Espeak | None = None
_instance_lock = threading.Lock()


class EspeakError(RuntimeError):
    """The library could not be loaded or refused a call."""


class Espeak:
    """The process's eSpeak NG (``Espeak.shared()``)."""

    def __init__(self) -> None:
        try:
            import espeakng_loader

            self._lib = ctypes.CDLL(espeakng_loader.get_library_path())
            data = espeakng_loader.get_data_path()
        except (ImportError, OSError, RuntimeError) as exc:
            raise EspeakError(f"eSpeak NG is not available (pip install espeakng-loader): {exc}") from exc
        self.sample_rate = int(self._lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, data.encode(), 0))
        if self.sample_rate <= 0:
            raise EspeakError(f"espeak_Initialize failed ({self.sample_rate})")
        self._chunks: list[FloatArray] = []
        # Kept on the instance: the library calls it for as long as the process lives.
        self._callback = _CALLBACK(self._on_audio)
        self._lib.espeak_SetSynthCallback(self._callback)
        self._lock = threading.Lock()
        self._voice = ""
        self._wpm = 0

    @classmethod
    def shared(cls) -> Espeak:
        global _instance
        with _instance_lock:
            if _instance is None:
                _instance = cls()
            return _instance

    def _on_audio(self, wav: ctypes._Pointer[ctypes.c_short], n: int, events: int | None) -> int:
        del events
        if n > 0:
            self._chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).astype(np.float32) / 32768.0)
        return 0

    def synthesize(self, text: str, *, voice: str = "en-us", wpm: int = 160) -> FloatArray:
        """``text`` spoken, float32 mono at ``sample_rate``."""
        data = text.encode("utf-8")
        with self._lock:
            if voice != self._voice:
                if self._lib.espeak_SetVoiceByName(voice.encode()) != 0:
                    raise EspeakError(f"no eSpeak NG voice {voice!r}")
                self._voice = voice
            if wpm != self._wpm:
                self._lib.espeak_SetParameter(_RATE, wpm, 0)
                self._wpm = wpm
            self._chunks = []
            status = self._lib.espeak_Synth(
                ctypes.c_char_p(data),
                ctypes.c_size_t(len(data) + 1),
                0,
                _POS_CHARACTER,
                0,
                _CHARS_UTF8,
                None,
                None,
            )
            if status != 0:
                raise EspeakError(f"espeak_Synth failed ({status})")
            chunks, self._chunks = self._chunks, []
        return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
