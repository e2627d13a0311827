//! JSON Schemas of the kinds, for the OpenAPI document hearthd serves
//! (feature `openapi`). Most schemas are derived from the types themselves
//! (`utoipa::ToSchema`, which reads the serde attributes: `camelCase` names,
//! `deny_unknown_fields` as `additionalProperties: false`, defaults as "not
//! required"); this module writes by hand only what serde does by hand:
//! [`Quantity`] (a string with a suffix, or a number of bytes) and [`Object`]
//! (one of the kinds, told apart by `kind`).

use std::borrow::Cow;

use utoipa::openapi::RefOr;
use utoipa::openapi::schema::{
    Discriminator, ObjectBuilder, OneOfBuilder, Ref, Schema, SchemaType, Type,
};
use utoipa::{PartialSchema, ToSchema};

use crate::kinds::{
    Kind, VirtualDisk, VirtualDiskSnapshot, VirtualImage, VirtualMachine, VirtualMachineBackup,
    VirtualMachineSnapshot, VirtualMachineSnapshotGroup, VirtualMachineSnapshotSchedule,
    VirtualNetwork,
};
use crate::meta::API_VERSION;
use crate::object::Object;
use crate::quantity::Quantity;

/// What [`Quantity::parse`] accepts (it trims spaces first).
pub const QUANTITY_PATTERN: &str = r"^\s*[0-9]+(Ki|Mi|Gi|Ti|K|k|M|G|T)?\s*$";

impl PartialSchema for Quantity {
    fn schema() -> RefOr<Schema> {
        OneOfBuilder::new()
            .item(
                ObjectBuilder::new()
                    .schema_type(SchemaType::new(Type::String))
                    .pattern(Some(QUANTITY_PATTERN))
                    .examples(["256Mi"]),
            )
            .item(
                ObjectBuilder::new()
                    .schema_type(SchemaType::new(Type::Integer))
                    .minimum(Some(0)),
            )
            .description(Some(
                "A size in bytes: a whole number with an optional suffix Ki, Mi, Gi, Ti (powers of 1024) or K, M, G, T (powers of 1000), or a plain number of bytes. Read back as it was written.",
            ))
            .into()
    }
}

impl ToSchema for Quantity {}

impl PartialSchema for Object {
    fn schema() -> RefOr<Schema> {
        let mut discriminator = Discriminator::new("kind");
        let mut one_of = OneOfBuilder::new();
        for kind in Kind::ALL {
            one_of = one_of.item(Ref::from_schema_name(kind.as_str()));
            discriminator.mapping.insert(
                kind.as_str().to_string(),
                format!("#/components/schemas/{}", kind.as_str()),
            );
        }
        one_of
            .discriminator(Some(discriminator))
            .description(Some(
                "Any hearth object; its `kind` says which. Input ignores `status` and the server-set metadata.",
            ))
            .into()
    }
}

impl ToSchema for Object {
    fn schemas(schemas: &mut Vec<(String, RefOr<Schema>)>) {
        fn add<T: ToSchema>(kind: Kind, schemas: &mut Vec<(String, RefOr<Schema>)>) {
            schemas.push((kind.as_str().to_string(), pinned(kind, T::schema())));
            T::schemas(schemas);
        }
        add::<VirtualMachine>(Kind::VirtualMachine, schemas);
        add::<VirtualDisk>(Kind::VirtualDisk, schemas);
        add::<VirtualDiskSnapshot>(Kind::VirtualDiskSnapshot, schemas);
        add::<VirtualMachineSnapshot>(Kind::VirtualMachineSnapshot, schemas);
        add::<VirtualMachineSnapshotGroup>(Kind::VirtualMachineSnapshotGroup, schemas);
        add::<VirtualMachineSnapshotSchedule>(Kind::VirtualMachineSnapshotSchedule, schemas);
        add::<VirtualMachineBackup>(Kind::VirtualMachineBackup, schemas);
        add::<VirtualImage>(Kind::VirtualImage, schemas);
        add::<VirtualNetwork>(Kind::VirtualNetwork, schemas);
        for (name, schema) in schemas.iter_mut() {
            if name == "DiskSource" || name == "ImageSource" {
                close_variants(schema);
            }
        }
    }

    fn name() -> Cow<'static, str> {
        Cow::Borrowed("Object")
    }
}

/// A kind's schema with `apiVersion` and `kind` fixed to their one value (the
/// types hold them as strings, checked by validation): that is what makes
/// [`Object`]'s `oneOf` pick exactly one kind.
fn pinned(kind: Kind, schema: RefOr<Schema>) -> RefOr<Schema> {
    let RefOr::T(Schema::Object(mut object)) = schema else {
        return schema;
    };
    object.properties.insert(
        "apiVersion".to_string(),
        single_string(API_VERSION, "Always `hearth.dev/v1alpha1`."),
    );
    object.properties.insert(
        "kind".to_string(),
        single_string(kind.as_str(), "The kind of the object."),
    );
    for field in ["apiVersion", "kind"] {
        if !object.required.iter().any(|r| r == field) {
            object.required.push(field.to_string());
        }
    }
    RefOr::T(Schema::Object(object))
}

/// An externally tagged enum (`{variant: value}`) with `deny_unknown_fields`:
/// serde takes exactly one key, so each variant's object admits no other.
fn close_variants(schema: &mut RefOr<Schema>) {
    let RefOr::T(Schema::OneOf(one_of)) = schema else {
        return;
    };
    for item in &mut one_of.items {
        if let RefOr::T(Schema::Object(variant)) = item {
            variant.additional_properties = Some(Box::new(
                utoipa::openapi::schema::AdditionalProperties::FreeForm(false),
            ));
        }
    }
}

fn single_string(value: &str, description: &str) -> RefOr<Schema> {
    ObjectBuilder::new()
        .schema_type(SchemaType::new(Type::String))
        .enum_values(Some([value]))
        .description(Some(description))
        .into()
}
