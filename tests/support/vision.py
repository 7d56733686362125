"""Pictures made in the tests, and a tool that answers with one."""

from __future__ import annotations

from typing import Any

from PIL import Image

from agentloop.tools import BaseTool, ToolResponse


COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 60, 220)}


def picture(colour: str, width: int = 56, height: int = 56) -> Image.Image:
    """A solid-colour image with a white mark in one corner (so no two sizes or colours look alike)."""
    image = Image.new("RGB", (width, height), COLOURS[colour])
    image.paste((255, 255, 255), (0, 0, 8, 8))
    return image


def picture_message(colour: str, width: int, height: int) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [
            {"type": "text", "text": f"and this {colour} one?"},
            {"type": "image", "image": picture(colour, width, height)},
        ],
    }


class CameraTool(BaseTool):
    """Answers every call with a picture of the colour asked for (a tool whose response carries an image)."""

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        return (
            ToolResponse(text=f"a {parameters['colour']} picture", image=picture(parameters["colour"], 84, 56)),
            0.0,
            {},
        )


CAMERA_SCHEMA = {
    "type": "function",
    "function": {
        "name": "camera",
        "description": "Take a picture.",
        "parameters": {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]},
    },
}
